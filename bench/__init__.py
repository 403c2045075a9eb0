"""The benchmark harness: ``python -m bench`` (``--quick`` for a short run).

Every part runs against the local MariaDB in databases of its own (``ro_bench_*``, dropped
afterwards) and compares itself with a baseline measured in the same run, so the ratios mean
something on a noisy 2-core machine even when the absolute figures wander.
"""
