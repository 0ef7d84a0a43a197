"""The benchmark suite (`python -m bench`): every figure next to a baseline measured in the same
run, on one embedded Postgres with durability on. See docs/performance.md."""
