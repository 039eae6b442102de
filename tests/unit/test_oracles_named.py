"""Every truth check in the suite names its oracle (issue #30): a test that says a profile, symbol, stack, line,
SASS, file format, count or simulated result is right says, in a docstring line or a comment starting `Oracle:`,
what it is right against: an independent tool (perf, py-spy, nvdisasm, cuobjdump, binutils, Google's
profile.proto, Perfetto's schema, mlc-chakra's decoder, flamegraph.pl's reading), or a value the test built
itself (`by construction`). Never aiflame's own code alone.

The rule is made precise by two lists kept here. Every test module is in exactly one: TRUTH, the modules that
check truth, each with the names of its tests that check none (errors, plumbing, caches, crash fuzzing); or
NOT_TRUTH, with the reason the module checks no truth. A new test in a truth module names its oracle or is added
to its module's list; a new module is put in one list or the other. A test listed as checking no truth, or a
module listed as NOT_TRUTH, that names an oracle fails too: the lists stay true."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
ORACLE = re.compile(r"^\s*Oracles?:")
COMMENT = re.compile(r"^\s*#\s*Oracles?:")

# Truth modules -> the names (without `test_`) of their tests that check no truth; every other test of the module
# names its oracle.
TRUTH: dict[str, str] = {
    "integration/test_annotate.py": "command_output",
    "integration/test_chakra_ddp.py": "",
    "integration/test_daemon.py": (
        "non_root_clients_are_refused sighup_and_sigterm_mid_window_lose_nothing "
        "the_stop_watchdog_keeps_the_daemons_starting_priority trigger_refuses_bad_requests"),
    "integration/test_gpu_host.py": "",
    "integration/test_dump.py": (
        "dump_of_what_has_no_user_stack_is_one_line dump_survives_threads_exiting_while_it_reads"),
    "integration/test_launch_budget.py": "",
    "integration/test_launch_nesting.py": "",
    "integration/test_multinode.py": "",
    "integration/test_profile_all.py": "profile_all_with_a_target_is_one_line",
    "integration/test_profile_cpu.py": "ctrl_c_keeps_a_complete_capture target_is_never_left_stopped",
    "integration/test_profile_offcpu.py": "",
    "integration/test_python_detect.py": "gone_process not_python unsupported_version",
    "integration/test_python_profile.py": "unverified_version_warns_once_and_stays_native",
    "integration/test_runtime_cuda.py": "",
    "integration/test_runtime_gloo.py": "every_probed_symbol_is_in_libtorch_cpu",
    "integration/test_runtime_level_zero.py": "",
    "integration/test_runtime_level_zero_usdt.py": "",
    "integration/test_runtime_nccl.py": "",
    "integration/test_stall_merge.py": "",
    "integration/test_svg_browser.py": "",
    "integration/test_unwind_scan.py": "",
    "integration/test_unwind_background.py": "",
    "integration/test_unwind_uretprobe.py": "",
    "integration/test_unwind_vs_perf.py": "",
    "unit/test_annotate.py": (
        "ambiguous_names_list_candidates_and_dso_chooses annotation_is_a_value cli_errors_are_one_line "
        "kernel_and_host_stub_need_a_kind not_found_and_missing_binaries"),
    "unit/test_annotate_python.py": "a_name_nothing_matches_lists_the_hottest_of_both_kinds",
    "unit/test_cfi.py": (
        "cache_default_dir_is_under_symbols_cache cache_key_without_build_id_is_the_content_digest cache_round_trip "
        "cache_symlink_is_not_followed corrupt_cache_is_rebuilt decode_checks_structure_behind_a_valid_checksum "
        "default_row_cap_holds_on_a_big_table engine_is_compiled_atomically_into_a_private_dir fuzz_mutated_eh_frame "
        "fuzz_mutated_eh_frame_hdr fuzz_mutated_files fuzz_mutated_libc hostile_sections_give_one_clear_error "
        "layout_is_eight_byte_rows_into_twelve_byte_rules load_cached_reads_the_cache_and_never_builds "
        "not_x86_64_or_not_elf "
        "repeated_hdr_entries_are_interpreted_once row_and_rule_caps without_a_compiler_auto_falls_back_to_python"),
    "unit/test_chakra.py": (
        "decoder_fuzz decoder_rejects_malformed_bytes no_communication_is_a_clear_error rank_environment_fuzz "
        "rank_environment_parsing ranks_from_events_or_numbered_after"),
    "unit/test_chakra_calibration.py": (
        "a_call_not_calibrated_is_costed_as_the_kind_the_simulator_runs_it_as "
        "a_malformed_calibration_line_is_refused_in_one_line the_exporter_takes_a_calibrated_network_file "
        "too_few_sizes_is_refused_in_one_line"),
    "unit/test_chakra_check.py": "expand_prefixes_and_cli",
    "unit/test_chakra_replay.py": "checker_rejects_what_the_simulator_aborts_on",
    "unit/test_chakra_sim.py": "export_writes_the_network_and_checks",
    "unit/test_elf_header.py": "random_bytes_decode_or_raise_one_line malformed_headers_say_what_is_wrong",
    "unit/test_cubin.py": (
        "bit_flips_in_headers_and_tables corrupt_line_programs lookup_outside_and_unknown not_a_cubin "
        "random_bytes_behind_a_cuda_elf_header truncated_cubins"),
    "unit/test_cupti_stream.py": (
        "build_is_cached_and_rebuilt_per_key cut_stream_keeps_whole_records_and_says_so "
        "foreign_or_unreadable_streams_fail_with_one_line malformed_and_unknown_records_are_skipped_and_named "
        "planted_files_in_the_stream_directory_are_refused_fast reader_never_crashes_on_mutated_streams "
        "reader_never_crashes_on_random_records"),
    "unit/test_ehframe.py": "entry_count_beyond_the_section_is_an_error unknown_table_encoding_gives_no_starts",
    "unit/test_elf.py": (
        "find_debug_file_rejects_wrong_build_id_content read_build_id_is_fast_on_a_large_binary "
        "read_build_id_missing_directory_and_fifo read_build_id_rejects_non_elf short_name"),
    "unit/test_events.py": "events_and_gpu_code_round_trip",
    "unit/test_fatbin.py": (
        "bit_flips_in_headers container_errors_are_one_line corrupt_compressed_payloads decompress_payload_errors "
        "file_kinds only_selects_entries_by_offset random_bytes random_bytes_behind_a_fatbin_header "
        "random_compressed_payloads truncated_real_fatbins"),
    "unit/test_folded.py": (
        "frame_label_is_separator_safe frame_label_lines_only_for_native_kinds parse_folded_empty_input "
        "parse_folded_malformed_line parse_folded_raises_only_export_error "
        "parse_folded_tolerates_blank_lines_crlf_bom_and_tabs render_empty_profile_is_empty render_lines_option "
        "with_separator_returns_same_stack_when_nothing_to_do write_is_atomic_and_leaves_no_temporary_file "
        "write_to_missing_directory_is_an_export_error"),
    "unit/test_gpu_symbols.py": (
        "cli_bad_arguments cli_errors kernel_name_forms lookup_errors no_device_code nvdisasm_failure_is_a_note "
        "parse_arch resolve_kernel_rules sass_cache_ignores_garbage without_nvdisasm"),
    "unit/test_job_join.py": (
        "a_capture_without_a_clock_pair_is_refused a_rank_in_two_captures_is_refused_and_a_missing_rank_named "
        "the_joined_job_is_one_chakra_set"),
    "unit/test_kallsyms.py": "load_missing_file_raises_oserror",
    "unit/test_minidebug.py": (
        "compressed_size_is_capped decompression_bomb_is_capped hostile_sections_never_crash "
        "malformed_section_is_one_clear_error"),
    "unit/test_native_symbolizer.py": (
        "a_saved_index_from_other_sources_is_read_again binary_that_appears_later_is_symbolized "
        "build_id_mismatch_ignores_the_file cache_dir_from_environment "
        "cache_written_before_debug_file_appeared_is_stale corrupt_cache_is_ignored_and_rewritten "
        "deleted_suffix_and_root disk_cache_in_a_new_process disk_cache_merges_new_offsets "
        "disk_cache_serves_a_fresh_symbolizer memo_avoids_reparsing new_offsets_later_read_the_saved_function_symbols "
        "parse_errors_give_unknowns unknown_offsets_keep_their_module unreadable_binary_gives_unknowns "
        "unwritable_cache_dir_is_harmless"),
    "unit/test_offcpu.py": (
        "capture_format_says_it_holds_off_cpu_samples folded_marker_reads_back_as_off_cpu "
        "off_cpu_views_of_a_capture_without_them_are_refused off_cpu_with_the_whole_host_is_a_usage_error "
        "threads_that_block_and_die_cannot_grow_the_pairs wall_view_of_a_capture_without_off_cpu_is_one_line"),
    "unit/test_perfetto_trace.py": "",
    "unit/test_pprof.py": "",
    "unit/test_python_code.py": (
        "decode_unicode_garbage line_for_never_raises resolve_rejects_non_code resolver_on_dead_process"),
    "unit/test_python_layouts.py": (
        "debug_offsets_errors debug_offsets_fuzz_mutated debug_offsets_fuzz_random debug_offsets_mismatch_is_reported "
        "generator_reproduces_checked_in_json layout_from_json_rejects_malformed unverified_versions_have_no_layout"),
    "unit/test_python_merge.py": "",
    "unit/test_report.py": "no_collectives_is_an_error",
    "unit/test_rocprof_pc.py": "fuzzed_tails_give_one_line_errors malformed_files sizes_match_the_c_layouts",
    "unit/test_runtime_gloo.py": (
        "bad_layouts_are_flagged context_with_rank_outside_its_size_is_flagged_and_not_used decode_never_raises "
        "failed_reads_leave_values_out_and_say_so forget_drops_the_process "
        "option_reads_fit_a_probe_and_chain_from_the_buffer_pointer "
        "send_without_transport_or_with_a_bad_peer_is_flagged wants_libtorch_cpu_only"),
    "unit/test_runtime_level_zero.py": (
        "decode_never_raises module_create_failed_reads module_destroy_and_forget specs_and_library "
        "unknown_kernel_and_unread_group_counts"),
    "unit/test_runtime_nccl.py": (
        "capture_end_before_return_has_no_ret decode_never_raises destroy_and_forget_drop_communicators "
        "failed_init_reports_the_request_but_names_no_communicator failed_stack_reads_leave_the_arguments_out "
        "huge_values_fit_the_capture init_all_with_the_array_gone_keeps_the_first "
        "specs_probe_both_names_and_want_only_libnccl unknown_dtype_and_custom_op"),
    "unit/test_speedscope.py": "unusual_names_survive",
    "unit/test_stacks.py": "",
    "unit/test_stalls.py": "reason_labels",
    "unit/test_summary_events.py": "stall_counters_keep_their_bracketed_names",
    "unit/test_svg.py": (
        "bad_options data_kinds_and_colours empty_profile_says_no_samples labels_are_cut_to_fit "
        "large_profile_renders_quickly lines_option no_subtitle_element_by_default "
        "script_is_embedded_with_zoom_and_search title_subtitle_and_svg_attributes"),
    "unit/test_svg_diff.py": "",
    "unit/test_top_view.py": "the_leaf_is_never_cut_at_80_columns",
    "unit/test_usdt.py": "bad_args fuzz_args fuzz_never_crashes malformed",
    "unit/test_xe_eu_stall.py": (
        "fuzzed_buffers_never_raise_and_account_for_every_record platform_and_size_errors "
        "more_than_one_foreign_record_in_a_hundred_is_refused"),
    "unit/test_xe_stream.py": (
        "driver_without_eu_stall_is_explained_from_the_real_ioctl finds_only_xe_render_nodes "
        "open_errors_are_one_line_each query_reply_parsers_fail_only_with_one_line "
        "read_loop_hands_records_to_the_parser this_host_says_clearly_it_has_no_xe_device"),
}

# Modules whose tests check no truth of a profile, symbol, stack, line, SASS, format, count or result: why.
NOT_TRUTH: dict[str, str] = {
    "integration/test_bpf_cache.py": "the compile cache: a hit loads and samples as a compile does",
    "integration/test_bpf_files.py": "each BPF program file compiles alone; the program text holds each header once",
    "integration/test_bpf_object.py": "BPF object plumbing: maps, the ring buffer, descriptors",
    "integration/test_cli_errors.py": "one-line errors for bad input",
    "integration/test_cupti_inject.py": "the injection library's contract with no GPU; stall truth is GPU-only",
    "integration/test_hostile.py": "attacks by an unprivileged user (issue #20)",
    "integration/test_hostile_daemon.py": "attacks on the daemon by an unprivileged user (issue #20)",
    "integration/test_install.py": "packaging: pip install into a fresh venv",
    "integration/test_records_layout.py": "our C header against our Python mirror: two of our definitions kept equal",
    "integration/test_top.py": "the terminal view's behaviour (quit, Ctrl-C, no target left stopped)",
    "integration/test_unit_sandbox.py": "the systemd unit's sandbox",
    "integration/test_uprobes.py": "how probes are attached (one link per file and direction)",
    "unit/test_bpf_cache.py": "the compile cache's key, entry format and checks",
    "unit/test_capture.py": "our own capture format: round trip and damage (no other reader exists)",
    "unit/test_cli.py": "the command line's shape",
    "unit/test_cli_outputs.py": "where export and render write",
    "unit/test_cupti_build.py": "building the injection library",
    "unit/test_daemon_captures.py": "daemon plumbing with fakes",
    "unit/test_daemon_collector.py": "daemon plumbing: warnings logged once",
    "unit/test_daemon_config.py": "the configuration parser",
    "unit/test_daemon_control.py": "the control socket",
    "unit/test_daemon_discovery.py": "discovery of runtimes in /proc maps",
    "unit/test_daemon_protocol.py": "the control protocol",
    "unit/test_daemon_rolling.py": "rolling windows with fakes",
    "unit/test_daemon_server.py": "daemon plumbing with fakes",
    "unit/test_daemon_signals.py": "the main loop's signals",
    "unit/test_daemon_status.py": "status requests",
    "unit/test_daemon_store.py": "the output tree's publication and retention",
    "unit/test_deploy.py": "the two deployments say the same thing",
    "unit/test_dump_walks.py": "walks over hostile memory end",
    "unit/test_elf_fuzz.py": "hostile bytes raise only Unreadable",
    "unit/test_sample_path.py": "which modules and layers a CPU sample crosses: the code's structure, not a result",
    "unit/test_errors.py": "the error kinds: every exception class a kind or a listed exception, their exit statuses",
    "unit/test_exporter_registry.py": "the exporter registry and its options",
    "unit/test_import_inputs.py": "inputs of the wrong kind refused",
    "unit/test_inflate.py": "decompression and size bombs",
    "unit/test_launch_log.py": "the launch log's bounds",
    "unit/test_longest_stop.py": "the hostile tests' own stop watcher",
    "unit/test_nvidia_host.py": "doctor's checks of a driver's /proc tree",
    "unit/test_obfuscate.py": "a transform checked against its own input: names hashed, the rest unchanged",
    "unit/test_oracles_named.py": "this rule's own check",
    "unit/test_package_data.py": "what a wheel carries",
    "unit/test_procmaps.py": "a process snapshot's bookkeeping",
    "unit/test_procs.py": "process states, descendants and re-reads",
    "unit/test_python_attach.py": "attach retries",
    "unit/test_records.py": "record decoding against our own C header's constants; layouts: test_records_layout",
    "unit/test_road.py": "which views are written where, each as `export` writes it",
    "unit/test_runtime_manager.py": "the probe manager with a fake sampler",
    "unit/test_safe_files.py": "files a user plants where root reads and writes",
    "unit/test_stack_dedupe.py": "an optimisation checked against the unoptimised path",
    "unit/test_summary.py": "the summary's unwinder line",
    "unit/test_symindex.py": "a cache format checked against the symbol list it was made from",
    "unit/test_unit_hardening.py": "parsing unit files for doctor",
    "unit/test_unwind_pool.py": "the unwind row pool's bookkeeping",
}


def _modules() -> list[str]:
    return sorted(str(p.relative_to(TESTS)) for d in ("unit", "integration") for p in (TESTS / d).glob("test_*.py"))


def _tests(module: str) -> dict[str, bool]:
    """Each test function of the module -> whether it names its oracle (docstring line or comment in its body)."""
    path = TESTS / module
    source = path.read_text()
    lines = source.splitlines()
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_"):
            doc = ast.get_docstring(node) or ""
            body = lines[node.lineno - 1 : node.end_lineno]
            out[node.name] = any(ORACLE.match(ln) for ln in doc.splitlines()) or any(COMMENT.match(ln) for ln in body)
    return out


def test_every_module_is_listed_once() -> None:
    modules = _modules()
    both = set(TRUTH) & set(NOT_TRUTH)
    assert not both, f"in both lists: {sorted(both)}"
    listed = set(TRUTH) | set(NOT_TRUTH)
    assert not set(modules) - listed, f"put these in TRUTH or NOT_TRUTH: {sorted(set(modules) - listed)}"
    assert not listed - set(modules), f"listed but gone: {sorted(listed - set(modules))}"


@pytest.mark.parametrize("module", sorted(TRUTH))
def test_truth_checks_name_their_oracle(module: str) -> None:
    tests = _tests(module)
    plumbing = {"test_" + name for name in TRUTH[module].split()}
    assert not plumbing - set(tests), f"listed as checking no truth but gone: {sorted(plumbing - set(tests))}"
    unnamed = [name for name, named in tests.items() if not named and name not in plumbing]
    assert not unnamed, f"name the oracle (a line starting `Oracle:`) or list as checking no truth: {unnamed}"
    named = [name for name in plumbing if tests[name]]
    assert not named, f"these name an oracle: take them off the list of tests checking no truth: {named}"


@pytest.mark.parametrize("module", sorted(NOT_TRUTH))
def test_modules_that_check_no_truth_name_no_oracle(module: str) -> None:
    named = [name for name, has in _tests(module).items() if has]
    assert not named, f"{module} names oracles ({named}): move it to TRUTH"
