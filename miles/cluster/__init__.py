"""Scale-out: trainer ranks and engine servers hosted by Ray, supervised by the driver.

`miles train` with `--actor-num-nodes` / `--actor-num-gpus-per-node` runs its trainer as N x G
Ray actors in a placement group (`TrainerGroup`, one `TrainerWorker` per rank, FSDP2 over
torch.distributed: NCCL on GPUs, gloo on a host without them), and the servers of
`--rollout-backend sglang|vllm` as `EngineActor`s that own the server processes: on their own
bundles, or with `--colocate` on the trainer's. The loop does not know: a `TrainerGroup` is a
trainer, engines are a `RemoteEngine` over the actors' URLs.

Supervision (supervisor.py): every call to the ranks is watched; a dead or failed worker becomes
`WorkerCrashed` naming it, its node and its first error, and the whole group is torn down.
"""
