"""The queue contract between the API, the scheduler and the workers, importable without torch.

The API stores each accepted request as a row (its `RequestKind` and its payload: a JSON model of
contract/payloads.py, or the protobuf body of a forward/forward_backward) and queues a
`QueuedRequest`; the scheduler plans `Cycle`s of them and hands each cycle's `Job`s to an
`Executor` (contract/executor.py), which runs them on a trainer engine (workers/trainer/executor.py,
in this process, a child process, or a Celery worker) and answers one `Outcome` per request
(contract/queue.py). Engine errors (contract/errors.py) become outcomes in Tinker's categories.

Nothing here imports torch: API replicas and the scheduler load only this side of the contract.
"""
