# bonsai — two commands on a fresh machine: `make demo` (install + main job), `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BONSAI := $(VENV)/bin/bonsai
# CPU machines and CI take torch 2.13.0; GPU users can say `make install TORCH=torch` for the newest CUDA build.
TORCH ?= torch==2.13.0
# A second Triton for the kernel compile check (tests/test_kernel_compile.py): the one torch 2.11 pins (our H200's stack)
COMPAT_TRITON ?= triton==3.6.0
# NVRTC for the CUDA C++ compile check without a GPU (tests/test_cuda_rt.py; torch's CUDA wheels carry their own)
NVRTC ?= nvidia-cuda-nvrtc-cu12==12.9.86
PYTEST_ARGS ?=

.PHONY: install demo test test-fast clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q "$(TORCH)"
	$(PY) -m pip install --disable-pip-version-check -q -e ".[test]"
	$(PY) -m pip install --disable-pip-version-check -q --no-deps --target $(VENV)/triton-3.6 "$(COMPAT_TRITON)"
	$(PY) -m pip install --disable-pip-version-check -q --no-deps --target $(VENV)/nvrtc "$(NVRTC)"
	touch $@

demo: install
	$(BONSAI) pull smollm2-135m
	$(BONSAI) info smollm2-135m
	$(BONSAI) generate smollm2-135m --chat --max-tokens 64 \
		--prompt "Explain in three sentences why small language models are useful."
	$(BONSAI) bench smollm2-135m -p 64 -n 32 -r 3 --json bench-out/model.json --plot bench-out/model.png
	$(BONSAI) bench smollm2-135m --suite short -r 1 --json bench-out/suite.json --plot bench-out/suite.png

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
