"""The SDK's wire-level types that the server shares (loraplex.types): one definition for both sides."""

from loraplex.types import SAMPLING_DEFAULTS, SampledSequence, format_sequence_id, policy_version_of


def test_a_sequence_id_names_its_policy_version_both_ways():
    assert format_sequence_id("sampler-1:7", 2, 5) == "sampler-1:7:2@v5"
    assert format_sequence_id("req", 0, None) == "req:0@base"
    for version in (None, 0, 5, 12345):
        assert policy_version_of(format_sequence_id("s:1", 3, version)) == version
    assert policy_version_of("no-version-here") is None and policy_version_of("x@vlatest") is None
    sequence = SampledSequence(tokens=[1], logprobs=[-0.1], stop_reason="stop", sequence_id="s:0:0@v3")
    assert sequence.policy_version == 3


def test_the_servers_sampling_defaults_are_the_sdks():
    from api.routes.sampling import SamplingParamsIn
    from contract.sampling import SamplingOptions

    server, job = SamplingParamsIn(), SamplingOptions(max_tokens=1)
    for name in ("temperature", "top_k", "top_p"):
        assert getattr(server, name) == getattr(job, name) == getattr(SAMPLING_DEFAULTS, name), name
