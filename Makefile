# Two commands for a newcomer: `make demo` (a traced 2-rank run and what it shows) and
# `make test`. Each sets up its own virtual environment on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
TT := $(VENV)/bin/tensor-trace
DEMO_OUT ?= tensor-trace-out

.PHONY: demo test venv sglang-venv clean

venv: $(VENV)/.installed

# torch is installed first and pinned to the CPU build, so that pip never pulls a CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,otlp]'
	touch $@

demo: venv
	OMP_NUM_THREADS=1 $(TT) record --replace -o $(DEMO_OUT) -- \
		$(VENV)/bin/torchrun --nproc-per-node 2 examples/tp_llama.py --steps 4
	@echo; echo "== Is the embedding output pre- or post-reduction?"
	$(TT) query reduction model.embed_tokens --trace $(DEMO_OUT)
	@echo; echo "== Placement of layer 0's points"
	$(TT) query placement 'model.layers.0.*' --trace $(DEMO_OUT)
	@echo; echo "== Collectives per module"
	$(TT) query collectives --trace $(DEMO_OUT)
	@echo; echo "== What feeds the EAGLE-3 draft head, and from where"
	$(TT) query lineage draft.fc:input.0 --trace $(DEMO_OUT)
	@echo; echo "== Keep it that way: a capture contract, then a run wired like the bug in DEVELOPERS.md"
	$(TT) contract save draft.fc:input.0 -o $(DEMO_OUT)/eagle3-contract.json --trace $(DEMO_OUT)
	OMP_NUM_THREADS=1 $(TT) record --replace -o $(DEMO_OUT)-miswired -- \
		$(VENV)/bin/torchrun --nproc-per-node 2 examples/tp_llama.py --steps 2 --aux-layer-ids=-1,0,2 > /dev/null
	-$(TT) contract check $(DEMO_OUT)/eagle3-contract.json --trace $(DEMO_OUT)-miswired
	@echo; echo "== One timeline of both ranks, for https://ui.perfetto.dev"
	$(TT) export perfetto --trace $(DEMO_OUT)

# The SGLang tests need their own venv (SGLang 0.5.23 on CPU, about 2 minutes the first time).
sglang-venv:
	bash tests/sglang/setup.sh

# One pytest run, so that its closing line counts every test. The SGLang venv is built in the
# background meanwhile; tests/sglang run last (tests/conftest.py) and wait for it (their conftest
# reads the status file). pytest's exit 5 (no tests) fails like any other non-zero exit.
test: venv
	@status=$$(mktemp -u); log=$$(mktemp); \
	(bash tests/sglang/setup.sh > $$log 2>&1; echo $$? > $$status) & \
	TT_SGLANG_SETUP_STATUS=$$status TT_SGLANG_SETUP_LOG=$$log OMP_NUM_THREADS=1 \
		$(PY) -m pytest tests -q -p no:cacheprovider; rc=$$?; \
	wait; rm -f $$status $$log; exit $$rc

clean:
	rm -rf $(VENV) build dist *.egg-info tensor-trace-out
