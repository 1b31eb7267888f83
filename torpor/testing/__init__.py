"""What users of torpor need to check their own set-up: the bit-exact sleep/wake harness and the soak
(`torpor demo` and `torpor bench sleep` run them too)."""

from torpor.testing.harness import differences, fixed_requests, run_harness, run_round, soak

__all__ = ["differences", "fixed_requests", "run_harness", "run_round", "soak"]
