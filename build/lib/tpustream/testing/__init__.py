"""Stand-ins for the services tpustream talks to, for the demo, the tests and the benchmarks.

``emulator``: a local GCS (fake-gcs-server on 127.0.0.1). Nothing in training
imports this package.
"""
