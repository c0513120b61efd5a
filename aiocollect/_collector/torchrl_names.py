"""TorchRL collector arguments that aiocollect has no option for, each with what to write instead
(the answers of the migration page's table), so that a ported script's first error says the fix."""

_DROP = "drop it"

TORCHRL_NAMES = {
    "num_collectors": "use num_workers= (worker processes, each stepping envs_per_worker envs)",
    "reset_when_done": f"an env is always reset as soon as its episode ends (TorchRL's reset_when_done=True); {_DROP}",
    "use_buffers": f"batch slots are always preallocated in shared memory from the env's spaces; {_DROP}",
    "trust_policy": f"the policy's outputs are probed once at start, actions checked against the action space; "
                    f"{_DROP}",
    "no_cuda_sync": f"envs step on the CPU, so there is no CUDA sync to skip; {_DROP}",
    "num_threads": f"aiocollect leaves your process's torch threads alone (each worker runs torch on one "
                   f"thread); {_DROP}",
    "num_sub_threads": f"each worker runs torch on one thread; {_DROP}",
    "cat_results": f"sync batches are always [num_workers * envs_per_worker, T], workers' rows stacked; {_DROP}",
    "track_traj_ids": f"('collector', 'traj_ids') is always in every batch; {_DROP}",
    "track_policy_version": f"('collector', 'policy_version') is always in every frame; {_DROP}",
    "extend_buffer": f"a replay buffer always receives whole batches; {_DROP}",
    "replay_buffer": "pass it when starting: await collector.start(replay_buffer=rb) collects into it in the "
                     "background",
    "interruptor": "delivery='async' serves the first worker ready instead of cutting the others short",
    "set_truncated": "not supported: the last frame of a batch is not marked truncated, and a trajectory that "
                     "crosses batches keeps its ('collector', 'traj_ids'); drop it",
    "pre_collect_hook": "register it with collector.on(BeforeRollout, hook) (aiocollect.events.BeforeRollout)",
    "post_collect_hook": "register it with collector.on(AfterRollout, hook) (aiocollect.events.AfterRollout), "
                         "or pass postproc=",
    "weight_updater": f"weight transport is built in (await collector.update_weights(policy)); {_DROP}",
    "weight_sync_schemes": f"weight transport is built in (await collector.update_weights(policy)); {_DROP}",
    "collector_class": f"every worker is the same kind of collector; {_DROP}",
    "auto_register_policy_transforms": f"envs are gymnasium envs, never wrapped in TorchRL transforms; {_DROP}",
    "max_batch_size": "not supported: a forward pass serves every env waiting (env_batch_size= sets the least)",
    "min_batch_size": "use env_batch_size= (with inference='server')",
    "yield_completed_trajectories": "use trajs_per_batch= (batches of complete episodes)",
    "backend_options": f"the backends take no options here; {_DROP}",
    "compact_obs": "not supported: observation and ('next', 'observation') are both stored; drop it",
    "device_config": "pass policy_device=, storing_device= and env_device= one by one",
    "server_config": "pass env_batch_size=, worker_groups=, compile_policy= and cudagraph_policy= one by one",
    "worker_affinity": "use worker_cpus= (one set of CPUs for every worker, or a list of one set per worker)",
    "driver_affinity": "set your own process's CPUs (os.sched_setaffinity(0, cpus)): the server runs in a thread of it",
    "env_backend": "num_workers>=1 steps envs in worker processes, num_workers=0 in your process",
    "policy_backend": f"with inference='server' the policy runs in a thread of your process; {_DROP}",
    "env_exchange": f"envs always exchange data through shared memory; {_DROP}",
    "transport": f"there is one transport (shared memory, eventfds); {_DROP}",
    "transition_chunk_size": f"a worker writes its frames in place and reports once per batch; {_DROP}",
    "server_timeout": "not supported: env_batch_size= never waits for a worker between its batches; drop it",
    "init_fn": "not supported: a policy_factory= or an env factory runs in each worker; drop it",
    "preemptive_threshold": "not supported: delivery='async' serves the first worker ready; drop it",
    "trajs_per_write": "not supported: with start(replay_buffer=rb) each delivered batch is one extend; drop it",
    "policy_version": "not supported: versions start at 0 (load_state_dict restores the counters); drop it",
    "policy_version_key": f"the version is always ('collector', 'policy_version'); {_DROP}",
    "verbose": "use progress=True for a bar; events and stats() report the rest",
    "weight_sync": f"weight transport is built in (await collector.update_weights(policy)); {_DROP}",
    "weight_sync_model_id": "pass model_id='policy.<submodule>' to update_weights",
    "weight_recv_schemes": f"weight transport is built in; {_DROP}",
    "worker_idx": f"workers are numbered by the collector; {_DROP}",
}
"""TorchRL's argument -> what aiocollect takes instead (see the migration page)."""

_NONE = "no equivalent"
_WEIGHTS = f"{_NONE}: weight transport is built in (await collector.update_weights(policy))"
_REMOTE = f"{_NONE}: envs and policy replicas live in the workers"

TORCHRL_ATTRIBUTES = {
    "next": "use await collector.collect() (one batch)",
    "rollout": "use await collector.collect() (one batch)",
    "async_shutdown": "use await collector.aclose() (or await collector.shutdown())",
    "is_running": "use collector.state is CollectorState.RUNNING (from aiocollect import CollectorState)",
    "get_policy_version": "use collector.policy_version (the latest published) or collector.worker_versions "
                          "(what each worker applied)",
    "increment_version": f"{_NONE}: each update_weights() adds one to collector.policy_version",
    "get_model": f"{_NONE}: models are named 'policy' or 'policy.<submodule>' in update_weights(model_id=...)",
    "get_cached_weights": f"{_NONE}: models are named 'policy' or 'policy.<submodule>' in update_weights(model_id=...)",
    "init_updater": _WEIGHTS,
    "receive_weights": _WEIGHTS,
    "register_scheme_receiver": _WEIGHTS,
    "weight_updater": _WEIGHTS,
    "set_post_collect_hook": "use collector.on(AfterRollout, fn) (from aiocollect.events import AfterRollout)",
    "pre_collect_hook": "use collector.on(BeforeRollout, fn) (from aiocollect.events import BeforeRollout)",
    "post_collect_hook": "use collector.on(AfterRollout, fn) (from aiocollect.events import AfterRollout)",
    "getattr_rb": f"{_NONE}: a replay buffer is yours (start(replay_buffer=rb))",
    "get_distant_attr": _REMOTE,
    "cascade_execute": _REMOTE,
    "worker_idx": f"{_NONE}: a sync batch stacks each worker's envs_per_worker rows in worker order",
    "reset": "not supported yet: reset_at_each_iter=True resets every env at each batch",
    "fake_tensordict": "not supported yet: collect one batch (await collector.collect()) to see its keys and shapes",
    "frames_per_batch_worker": "not supported yet: each worker fills frames_per_batch // num_workers frames of a "
                               "sync batch",
    "server_stats": "use collector.stats().server (with inference='server')",
    "trajs_per_batch": "use collector.config.trajs_per_batch (every option is in collector.config)",
    "traj_format": "use collector.config.traj_format (every option is in collector.config)",
    "trajs_per_write": f"{_NONE}: with start(replay_buffer=rb) each delivered batch is one extend",
    "verbose": f"{_NONE}: progress=True shows a bar; events and stats() report the rest",
    "profile_config": "use the ProfileConfig that collector.enable_profile(...) returns (or collector.config.profile)",
    "server_backend": f"{_NONE}: with inference='server' the policy runs in a thread of your process",
    "env": _REMOTE,
    "policy": f"{_NONE}: the policy is the object you passed (collector.config.policy)",
}
"""TorchRL's collector methods and attributes that a Collector lacks -> what to use instead, for
the AttributeError a ported script meets (the migration page's table of methods)."""

__all__ = ["TORCHRL_ATTRIBUTES", "TORCHRL_NAMES"]
