"""The three call sites, driven through Bridge's real train_step."""
import functools


import bridge_fgo
from bridge_fgo.instrument.callsites import is_reloading_finalize
from support import harness

ORDER = ["zero_grad_buffer", "zero_grad", "offload", "param-buffer copy", "release", "forward-backward",
         "reload", "finalize(pg_collection=pg_collection)", "step", "scheduler.step"]


def flagged_rig(**kw):
    return harness.Rig(cfg=harness.config_container(harness.optimizer_config(offload_optimizer_states=True)), **kw)


def test_exact_order_three_method(three_method):
    bridge_fgo.patch()
    rig = flagged_rig()
    harness.run_steps(rig, steps=3)
    assert rig.events == ORDER * 3


def test_rerun_loop_offloads_each_pass(three_method):
    bridge_fgo.patch()
    rig = flagged_rig()
    harness.run_steps(rig, steps=1, reruns=2)
    one_pass = ORDER[:8]
    assert rig.events == one_pass + one_pass + ["step", "scheduler.step"]


def test_flag_off_no_call(three_method):
    bridge_fgo.patch()
    rig = harness.Rig()  # offload_optimizer_states not set
    harness.run_steps(rig, steps=2)
    assert "offload" not in rig.events and "release" not in rig.events and "reload" not in rig.events
    assert not is_reloading_finalize(rig.model_config.finalize_model_grads_func)


def test_unpatched_baseline_has_no_calls(three_method):
    rig = flagged_rig()
    harness.run_steps(rig, steps=1)
    assert rig.events == [e for e in ORDER if e not in ("offload", "release", "reload")]


def test_finalize_wrapper_installed_once_keeps_partial(three_method):
    bridge_fgo.patch()
    rig = flagged_rig()
    original = rig.model_config.finalize_model_grads_func
    harness.run_steps(rig, steps=2)
    first = rig.model_config.finalize_model_grads_func
    harness.run_steps(rig, steps=2)
    assert rig.model_config.finalize_model_grads_func is first
    assert is_reloading_finalize(first) and first.__wrapped__ is original
    assert not is_reloading_finalize(first.__wrapped__)  # never wraps its own wrapper
    assert isinstance(first.__wrapped__, functools.partial)
    assert first.keywords == {"pg_collection": harness.PG_COLLECTION}  # the partial's bound keyword
    assert rig.events.count("reload") == 4
    bridge_fgo.unpatch()
    assert rig.model_config.finalize_model_grads_func is original


def test_user_finalize_function_is_kept(three_method):
    bridge_fgo.patch()
    rig = flagged_rig()
    seen = []

    def users_finalize(model, num_tokens, pg_collection=None, force_all_reduce=False):
        seen.append((num_tokens, pg_collection, force_all_reduce))
        rig.events.add("users finalize")

    rig.model_config.finalize_model_grads_func = users_finalize
    harness.run_steps(rig, steps=1)
    assert rig.events[6:8] == ["reload", "users finalize"]
    assert seen == [(None, harness.PG_COLLECTION, False)]


def test_keyword_arguments_pass_through(three_method, train_module):
    (unpatched,) = harness.run_steps(flagged_rig())
    bridge_fgo.patch()
    rig = flagged_rig()
    with harness.cpu_train_module() as reset:
        reset(1)
        result = train_module.train_step(**rig.kwargs())  # every parameter this release's train_step has
    assert rig.events == ORDER
    assert len(result) == len(unpatched) >= 7  # the release's own tuple (7 values before 0.6, 8 since), untouched


def test_report_counts_calls(three_method):
    bridge_fgo.patch()
    rig = flagged_rig()
    harness.run_steps(rig, steps=2)
    (session,) = bridge_fgo.status().sessions
    assert session["calls"] == {"offload": 2, "release": 2, "reload": 2}
    assert session["mode"] == "three-method" and session["state"] == "resident" and session["steps"] == 2


def test_first_step_info_line(three_method, caplog_fgo):
    bridge_fgo.patch()
    harness.run_steps(flagged_rig(), steps=2)
    lines = [r.getMessage() for r in caplog_fgo.records if "offload active" in r.getMessage()]
    assert lines == ["[rank 0] offload active: mode=three-method, 1 optimizer(s), ? tensor(s), ? bytes offloaded per step"]


def test_wrapper_wrapped_by_someone_else_is_not_wrapped_again(three_method):
    bridge_fgo.patch()
    rig = flagged_rig()
    harness.run_steps(rig, steps=1)
    ours = rig.model_config.finalize_model_grads_func

    def profiler_probe(*a, **k):  # a plain closure over our wrapper, as a profiler would add
        rig.events.add("probe")
        return ours(*a, **k)

    rig.model_config.finalize_model_grads_func = profiler_probe
    del rig.events[:]
    harness.run_steps(rig, steps=2)
    assert rig.model_config.finalize_model_grads_func is profiler_probe
    assert rig.events.count("reload") == 2 and rig.events[6:9] == ["probe", "reload",
                                                                   "finalize(pg_collection=pg_collection)"]


def test_wrapper_replaced_outright_is_installed_again(three_method):
    bridge_fgo.patch()
    rig = flagged_rig()
    harness.run_steps(rig, steps=1)
    rig.model_config.finalize_model_grads_func = harness.finalize_recorder(rig.events)  # ours is gone
    del rig.events[:]
    harness.run_steps(rig, steps=1)
    assert rig.events == ORDER  # the reload still comes before finalization and the step
