"""Issue 28's 41 findings (and the suspicions it asked to check), each with its class and the
regression tests that reproduce it, as one index.

Three uses: ``test_findings_index.py`` checks that every finding has a test and that every test
named here exists; the suite's root ``conftest.py`` counts how these tests ended in a run, and the
reliability table prints one row per class (``_figures.ROWS``); ``docs/reliability.md`` points
here for the list. A test is named ``path::function`` (every parametrisation of it counts).
"""

from __future__ import annotations

from dataclasses import dataclass

WRONG = "wrong weights served"
FATAL = "engine or trainer killed"
HANG = "hangs and stalls"
LOSS = "data loss"
SPURIOUS = "spurious or wrong failures"
TYPED = "untyped errors, leaks, validation"

CLASSES = (WRONG, FATAL, HANG, LOSS, SPURIOUS, TYPED)


@dataclass(frozen=True)
class Finding:
    number: str  # "1".."41", "s:<what>" for a suspicion that held, "p3:<what>" for the third pass
    klass: str
    title: str
    tests: tuple[str, ...]


_LIFE = "tests/reliability/test_trust_lifecycle.py::"
_SNAP = "tests/reliability/test_trust_snapshots.py::"
_HASH = "tests/reliability/test_trust_hashes.py::"
_TORN = "tests/reliability/test_trust_torn.py::"
_STORE = "tests/reliability/test_trust_store.py::"
_STORE_T = "tests/transports/test_store_trust.py::"
_INPROC = "tests/engines/test_vllm_inprocess_trust.py::"
_RAY = "tests/engines/test_ray_trust.py::"
_MACHINE = "tests/reliability/test_publisher_machine.py::test_publisher_state_machine"
_THIRD = "tests/reliability/test_trust_third_pass.py::"

FINDINGS: tuple[Finding, ...] = (
    Finding("1", WRONG, "in-place restore from the trainer's live tensors", (
        _SNAP + "test_in_place_failed_verification_puts_back_the_previous_version_not_the_trainers_new_weights",
        _SNAP + "test_in_place_without_a_kept_copy_never_leaves_the_failed_weights_serving",
        _SNAP + "test_in_place_through_files_restores_the_previous_version_from_its_files",
        _MACHINE,
    )),
    Finding("2", WRONG, "merged roll-back to the trainer's new weights", (
        _SNAP + "test_failed_merged_update_rolls_back_to_the_previous_merge_not_the_trainers_new_weights",
        _SNAP + "test_failed_merged_verification_puts_the_previous_merge_back",
        _MACHINE,
    )),
    Finding("3", WRONG, "'unchanged' from a stale hash (restart, another run's record)", (
        _HASH + "test_resync_after_a_restart_drops_the_remembered_hash_of_a_name_another_job_reloaded",
        _HASH + "test_a_fresh_run_never_takes_another_runs_recorded_hash",
        _HASH + "test_unchanged_is_decided_on_the_engines_own_content_after_someone_swapped_an_in_place_name",
        _HASH + "test_a_fresh_run_on_a_shared_vllm_server_takes_the_hash_of_what_the_server_loaded",
    )),
    Finding("4", WRONG, "in-process engine ids shared by every job on the host", (
        _HASH + "test_a_fresh_run_never_takes_another_runs_recorded_hash",
    )),
    Finding("5", WRONG, "store root squatted by another user", (
        _STORE_T + "test_a_folder_of_another_user_is_refused_and_left_alone",
        _STORE_T + "test_a_folder_others_can_write_is_refused",
        _STORE_T + "test_a_squatted_default_root_is_refused_with_what_to_do",
        _STORE_T + "test_another_user_can_neither_read_nor_replace_what_the_store_wrote",
    )),
    Finding("6", WRONG, "embedding LoRA dropped by fsdp.export", (
        "tests/exporters/test_embedding_lora.py::test_export_keeps_the_embedding_factors_under_peft_names",
        "tests/exporters/test_embedding_lora.py::test_peft_engine_serves_peft_tokens_and_logprobs",
        "tests/engines/test_vllm_embedding_lora.py::test_vllm_serves_the_embedding_lora",
    )),
    Finding("7", WRONG, "Megatron layer_offsets out of order accepted (layers swapped)", (
        "tests/megatron/test_megatron_validation.py::test_layer_offsets_out_of_pipeline_order_are_refused",
        "tests/megatron/test_megatron_validation.py::test_layer_offsets_that_leave_a_gap_are_refused",
    )),
    Finding("8", WRONG, "trainer step during a no-copy publish went unnoticed", (
        _TORN + "test_a_step_during_a_tensor_load_is_refused_not_reported_ok",
        _TORN + "test_a_step_during_the_disk_write_pass_leaves_no_torn_version",
        _MACHINE,
    )),
    Finding("15", WRONG, "mixed fan-out reported a name one engine did not serve", (
        _HASH + "test_mixed_fan_out_serves_the_reported_name_on_every_engine",
    )),
    Finding("30", WRONG, "IPC version rebuilt after eviction with lora_B scaled twice", (
        _INPROC + "test_llm_evicted_ipc_versions_rebuild_with_peft_tokens",
        "tests/engines/test_vllm_ipc_trust.py::test_http_ipc_adapters_rebuilt_after_eviction_serve_peft_tokens",
    )),
    Finding("31", WRONG, "the same with every default (AsyncLLM, keep=2, rollout in flight)", (
        _INPROC + "test_async_rollout_on_v1_while_v2_v3_publish_keeps_peft_tokens",
        _INPROC + "test_random_walk_serves_exactly_what_each_report_names",
    )),
    Finding("32", WRONG, "forced retirement released the staged tensors under a running request", (
        _INPROC + "test_async_forced_retirement_keeps_the_running_requests_weights",
        _INPROC + "test_async_worker_keeps_released_tensors_for_its_running_request",
        _INPROC + "test_random_walk_serves_exactly_what_each_report_names",
    )),
    Finding("33", FATAL, "a retired version's LoRARequest killed the engine core", (
        _INPROC + "test_llm_retired_lora_request_fails_per_request",
        _INPROC + "test_async_retired_lora_request_fails_per_request",
    )),
    Finding("35", FATAL, "publish during the caller's llm.generate aborted the trainer (libzmq)", (
        _INPROC + "test_llm_publish_while_another_thread_generates",
        _INPROC + "test_llm_verify_while_another_thread_generates_is_refused",
    )),
    Finding("9", HANG, "sync pin/unpin/lease from a coroutine while apublish runs", (
        _LIFE + "test_sync_pin_from_a_coroutine_while_apublish_runs_never_deadlocks",
        _LIFE + "test_every_sync_call_from_a_loop_that_runs_apublish_names_its_async_twin",
    )),
    Finding("10", HANG, "close() while another thread's publish waits for the lock", (
        _LIFE + "test_close_while_another_threads_publish_waits_for_the_lock",
        _LIFE + "test_close_is_idempotent_and_every_call_after_it_is_a_typed_error",
    )),
    Finding("11", HANG, "publish/collect/close in a forked child", (
        _LIFE + "test_a_forked_child_never_blocks_on_the_parents_publisher",
        _MACHINE,
    )),
    Finding("12", HANG, "a stuck retirement redone inline by the next publish", (
        _LIFE + "test_a_stuck_retirement_is_cancelled_for_good_and_retried_later",
    )),
    Finding("13", HANG, "leaving the async context cost 10 s", (
        _LIFE + "test_leaving_async_with_after_apublish_has_no_fixed_stall",
    )),
    Finding("36", HANG, "sync publish on the AsyncLLM's own loop deadlocked", (
        _INPROC + "test_async_sync_publish_on_the_asyncllm_loop_is_refused",
    )),
    Finding("14", LOSS, "orphan sweep deleted through a symlink, outside the root", (
        _STORE + "test_the_orphan_sweep_never_deletes_through_a_symlink",
    )),
    Finding("16", SPURIOUS, "a stray folder under the name failed every publish", (
        _STORE + "test_foreign_entries_are_ignored_never_parsed_never_deleted",
        _STORE + "test_a_store_listing_survives_odd_version_names",
    )),
    Finding("17", SPURIOUS, "concurrent publish_adapter calls of one name failed", (
        _STORE + "test_concurrent_publish_adapter_calls_of_one_name_all_succeed",
        _STORE + "test_concurrent_apublish_adapter_calls_of_one_name_all_succeed",
        _STORE + "test_stateless_calls_to_different_engines_never_delete_files_one_still_serves",
    )),
    Finding("18", SPURIOUS, "a forked worker kept a dead trainer's run locked", (
        _STORE + "test_resuming_a_run_works_while_a_dead_trainers_worker_lives",
        _STORE + "test_a_dead_trainers_run_is_swept_while_its_worker_lives",
    )),
    Finding("19", SPURIOUS, "megatron.export(tp_size=10**7) ran out of memory", (
        "tests/megatron/test_megatron_validation.py::test_a_huge_grid_is_refused_before_anything_is_allocated",
    )),
    Finding("20", SPURIOUS, "the same engine listed twice", (
        _LIFE + "test_the_same_engine_twice_is_refused_at_construction",
    )),
    Finding("37", SPURIOUS, "a load vLLM refused while activating stayed registered (zombie)", (
        _INPROC + "test_llm_refused_activation_leaves_no_zombie",
    )),
    Finding("38", SPURIOUS, "Ray put the adapter's file once per tensor into the object store", (
        _RAY + "test_an_adapter_read_from_disk_enters_the_object_store_once",
    )),
    Finding("39", SPURIOUS, "a cached ObjectRef from an earlier Ray session failed every publish", (
        _RAY + "test_publishing_the_same_adapter_after_ray_restarts_puts_it_again",
    )),
    Finding("40", SPURIOUS, "a timed-out Ray load kept running and was served", (
        _RAY + "test_a_load_that_timed_out_is_not_served_and_publishing_it_again_loads_it",
    )),
    Finding("21", TYPED, "inspect --json crashed on malformed folders", (
        "tests/cli/test_inspect_hostile.py::test_garbage_gives_a_typed_error_exit_2_and_strict_json",
        "tests/cli/test_inspect_hostile.py::test_paths_and_options_that_are_no_adapter_exit_2",
    )),
    Finding("22", TYPED, "export megatron --shards with a bad pattern: traceback", (
        "tests/cli/test_cli_export_errors.py",
    )),
    Finding("23", TYPED, "Megatron rank=True, tp_size=1.0: bare torch TypeErrors", (
        "tests/megatron/test_megatron_validation.py",
    )),
    Finding("24", TYPED, "dataclasses.asdict(report) raised", (
        _LIFE + "test_asdict_works_for_every_report",
    )),
    Finding("25", TYPED, "pickled engines held the API key and URL password", (
        "tests/engines/test_secrets_trust.py::test_a_pickled_client_carries_no_secret_and_copies_keep_it",
        "tests/engines/test_secrets_trust.py::test_an_unpickled_client_without_its_secret_sends_nothing_and_says_how",
        "tests/engines/test_secrets_trust.py::test_a_key_from_the_environment_is_read_again_in_the_process_that_unpickles",
    )),
    Finding("26", TYPED, "the TRL callback never closed its publisher when training failed", (
        "tests/integrations/test_trl.py::test_a_train_that_raises_elsewhere_is_closed_by_the_with_block",
        "tests/integrations/test_trl.py::test_a_train_that_raised_is_closed_by_close_or_when_the_callback_is_collected",
        "tests/integrations/test_trl.py::test_an_export_that_raises_in_the_callback_closes_its_publisher",
    )),
    Finding("27", TYPED, "inspect said 'loads' for adapters lorasync refuses; NaN in its JSON", (
        "tests/cli/test_inspect_hostile.py::test_what_lorasync_refuses_every_engine_refuses",
        "tests/cli/test_inspect_hostile.py::test_nan_lora_alpha_is_written_as_a_json_string",
    )),
    Finding("28", TYPED, "Retention took NaN grace and drain_timeout", (
        _LIFE + "test_retention_refuses_what_is_not_a_number_of_its_kind",
        _LIFE + "test_publisher_refuses_the_same_numbers",
    )),
    Finding("29", TYPED, "asyncio.run per step abandoned retirement, reported nowhere", (
        _LIFE + "test_asyncio_run_per_step_reports_every_retirement",
        _LIFE + "test_a_retirement_left_on_a_stopped_loop_is_redone_and_reported",
    )),
    Finding("34", TYPED, "the worker's 'staged tensors missing' path raised ImportError", (
        _INPROC + "test_llm_missing_staged_tensors_is_vllms_not_found",
    )),
    Finding("41", TYPED, "a failed actor constructor reported as 'dead or restarting'", (
        _RAY + "test_an_actor_whose_constructor_failed_reports_why",
    )),
    Finding("s:echoed-auth", TYPED, "an engine echoing Authorization leaked base64(user:password)", (
        "tests/engines/test_secrets_trust.py::test_an_engine_echoing_the_request_in_its_error_leaks_no_secret",
        "tests/engines/test_secrets_trust.py::test_a_secret_cut_by_the_quote_limit_shows_no_part_of_it",
    )),
    Finding("s:query-token", TYPED, "a ?token= in an engine URL shown everywhere (and never sent)", (
        "tests/engines/test_secrets_trust.py::test_a_query_token_is_sent_with_every_request_and_never_shown",
    )),
    Finding("s:reports", TYPED, "LoraSyncCallback.reports grew without bound", (
        "tests/integrations/test_trl.py::test_reports_are_bounded_and_keep_the_failures",
    )),
    Finding("s:raise-ranks", HANG, "on_error='raise': rank 0 raised, the other ranks hung", (
        "tests/distributed/test_distributed_raise.py::test_an_engine_failure_raises_the_same_typed_error_on_every_rank",
        "tests/integrations/test_trl.py::test_a_failed_publish_stops_every_rank_of_a_distributed_run",
    )),
    Finding("p3:cancelled-verify", WRONG, "a cancelled in-place apublish left weights that failed verification serving", (
        _THIRD + "test_a_cancelled_in_place_verification_never_leaves_unverified_weights",
    )),
    Finding("p3:raised-step", SPURIOUS, "an optimizer step that raised made every later publish 'torn'", (
        _THIRD + "test_a_step_that_raised_does_not_make_later_publishes_torn",
        _THIRD + "test_a_step_running_in_another_thread_is_still_seen",
    )),
    Finding("p3:lease", WRONG, "lease() yielded a name no engine served (in place, unchanged)", (
        _THIRD + "test_lease_yields_the_name_that_serves_the_version",
    )),
    Finding("p3:run-turns", SPURIOUS, "stateless calls with one explicit run= refused each other", (
        _THIRD + "test_concurrent_stateless_calls_with_one_explicit_run_take_turns",
    )),
    Finding("p3:options", TYPED, "DistributedPublisher options, alpha_pattern inf, use_rslora 'false', root=''", (
        _THIRD + "test_distributed_publisher_options_are_checked_at_construction",
        _THIRD + "test_an_adapter_config_lorasync_cannot_scale_exactly_is_refused",
        _THIRD + "test_an_empty_root_is_refused_not_the_working_directory",
    )),
    Finding("s:world-readable", LOSS, "adapters in /dev/shm readable by every local user", (
        _STORE_T + "test_everything_the_store_creates_is_private_to_its_user",
    )),
    Finding("s:fork-run", LOSS, "a forked child wrote into its parent's run", (
        _STORE + "test_a_forked_child_never_writes_into_its_parents_run",
    )),
)


def by_class() -> dict[str, list[Finding]]:
    out: dict[str, list[Finding]] = {k: [] for k in CLASSES}
    for finding in FINDINGS:
        out[finding.klass].append(finding)
    return out


def class_of_test(nodeid: str) -> set[str]:
    """The classes a test (pytest node id) reports on: a test named here, any parametrisation,
    or every test of a file named here as a whole."""
    base = nodeid.split("[", 1)[0]
    path = base.split("::", 1)[0]
    return {f.klass for f in FINDINGS for t in f.tests if t == base or t == path}
