"""The pod launcher: run one command on every host of a Cloud TPU VM pod through gcloud, and watch it.

    python -m tpustream.pod --tpu NAME --zone ZONE --sync -- .venv/bin/python train.py accelerator=tpu ...

A pod job is "the same command on every host at once" (each host's xmp.spawn
starts one replica per local core). torch_xla's ``xla_dist`` launcher did that
until it was removed with XRT (torch_xla 2.1). ``gcloud ... ssh --worker=all``
can start it too, but it mixes the hosts' output, and when one host fails the
others keep waiting in a collective forever while gcloud waits for them.

So this package starts one ``gcloud compute tpus tpu-vm ssh --worker=I`` per
host, prefixes every output line with its host, and when one host fails it
stops the others and kills the training on every host: exactly the process
groups this launch started, which each host records in ~/.tpustream/runs.
With ``restart`` it relaunches a run that ended by preemption (exit 75: last.pt is saved, and
``resume=auto`` continues from it) or by a lost ssh connection (exit 255); with ``recreate``
it asks again for a spot or preemptible pod that was taken.

It runs on the user's machine, so it imports only the standard library (no
torch): `spec` (the LaunchSpec), `commands` (the gcloud commands and the shell
code they run on the hosts, pure), `tpu` (describe: state and hosts, waiting
for READY), `processes` (running gcloud here), `workers` (running the command
on every worker, stopping, restarting), `sync` (--sync: ship and install this
checkout), `types` (the slice table), `slice_spec` (how a pod was made, and its
record), `queued` (queued resources: ask, wait for ACTIVE, delete), `recreate`
(the pod of a launch: READY, or made again), `create` (the create and delete
commands), `gke` and `manifest_yaml` (the GKE JobSet manifest), `usage` (the
parsers' errors). Library code raises TpustreamError; only ``__main__`` turns
errors into exit codes.
"""
