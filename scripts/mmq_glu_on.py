"""A pytest plugin that sets support.MMQ_GLU (the fused gate/up GLU on mmq_small) for the session, to time it
against the default: `PYTHONPATH=scripts python3 -m pytest -p mmq_glu_on benchmarks/test_bench_model.py ...`."""

from opdispatch.plugins.cuda_matmul import support

support.MMQ_GLU = True
