"""The compute side: trainer and sampler engines, their kernels, and the threads they run on.

Batch invariance (a run's bits do not depend on who shares its batch; workers/sgmv/row_gemm.py)
needs MKL's GEMMs to give each row the same bits whatever the number of rows. MKL's default code
path does not on every CPU: on a Xeon with AMX and AVX512-FP16, on 2 threads, 177 of 300 row counts
of a SmolLM2-sized dX product gave other bits than a 300-row product. Its strict conditional
numerical reproducibility mode does, there and on the other machines measured; MKL reads the
variable at its first call, so it is set here, before any engine computes (a user's own
MKL_CBWR is kept).
"""

import os

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
