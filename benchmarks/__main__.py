"""``python -m benchmarks [NAME ...] [options]``: same as ``lorasync bench``."""

from benchmarks._runner import main

raise SystemExit(main())
