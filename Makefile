# aiflame — run `make help` for the targets. Everything runs as root (BPF needs it).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python

.DEFAULT_GOAL := help

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

setup: ## install Debian BCC + headers, link headers, mount tracefs, create .venv (idempotent)
	@./scripts/setup-host.sh

examples: setup ## build the bundled example workloads (examples/bin/)
	@$(MAKE) -s -C examples

demo: setup examples ## profile the training steps of a 2-rank gloo DDP job (from its first collective): flame graph, Chakra traces, balance report
	$(PY) -m aiflame profile -F 199 -o out/demo --force --formats folded,svg,chakra,perfetto --delay collective -- $(PY) examples/ddp_gloo.py --steps 200
	$(PY) -m aiflame report comm out/demo/profile.aiflame --plot out/demo/comm.svg
	@echo "open out/demo/profile.svg and out/demo/comm.svg in a browser, out/demo/profile.pftrace in ui.perfetto.dev;"
	@echo "Chakra traces for ASTRA-sim: out/demo/profile.<rank>.et with out/demo/profile.network.yml (docs/chakra.md)"

lint: setup ## ruff, mypy and the layer contracts (lint-imports, see pyproject.toml)
	$(PY) -m ruff check aiflame core cli agent symbolize exporters tests bench scripts
	$(VENV)/bin/lint-imports
	$(PY) -m mypy -p aiflame
	$(PY) -m mypy tests bench scripts

test: setup examples ## lint, type-check, unit tests and real BPF integration tests
	$(MAKE) -s lint
	$(PY) -m pytest tests

stress: setup examples ## the suite with every CPU busy (scripts/stress.sh: 2 busy loops per CPU, at least 4); TESTS=... picks tests
	./scripts/stress.sh $(PY) -m pytest $(or $(TESTS),tests)

hostile: setup examples ## issue #20's attacks by an unprivileged user, for real (part of make test too)
	$(PY) -m pytest tests/unit/test_safe_files.py tests/unit/test_inflate.py tests/integration/test_hostile.py \
		tests/integration/test_hostile_daemon.py tests/integration/test_unit_sandbox.py

fuzz: setup examples ## property tests with fresh random examples, 1000 each (make test draws the same ones every run)
	HYPOTHESIS_PROFILE=explore $(PY) -m pytest tests/unit -q

bench: setup examples ## benchmarks (minutes); results go to bench/results/ and BENCHMARKS.md figures
	$(PY) bench/run.py

install-agent: setup ## install the daemon: /usr/local/bin/aiflame, the systemd unit, /etc/aiflame/aiflame.toml; start it
	@./scripts/install-agent.sh

uninstall-agent: ## stop and remove the daemon's unit and /usr/local/bin/aiflame (keeps config and output)
	@./scripts/install-agent.sh --remove

proto: setup ## regenerate core/aiflame_capture_pb2.py from the schema
	$(PY) -m grpc_tools.protoc -Icore --python_out=core --pyi_out=core core/aiflame_capture.proto
	$(PY) -m grpc_tools.protoc -Iexporters --python_out=exporters --pyi_out=exporters exporters/pprof.proto

clean: ## remove build outputs (keeps .venv)
	rm -rf out build *.egg-info .mypy_cache .ruff_cache .pytest_cache
	@$(MAKE) -s -C examples clean

.PHONY: help setup examples demo lint test stress hostile fuzz bench install-agent uninstall-agent proto clean
