# make demo: train the RoPE model on the embedded Shakespeare and print a sample (GPU if there is one, else CPU).
# make test: the whole test suite. Both create .venv on first use: demo installs requirements.txt (training, sampling,
# plots), test and lint requirements-dev.txt (every command's packages, and the test and lint tools).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: demo test lint

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: requirements.txt | $(PY)
	$(PIP) -r requirements.txt
	touch $@

# uv installs the test tools, lm-eval and everything else from the same pins, a minute faster than pip. It does not
# read pip's configuration, so it is given pip's find-links (where pip is set to find wheels on local disk, such as a
# CPU build of torch). Not compiled to bytecode at install (15 s for 1.6 GB of packages): the tests write the bytecode
# of what they import, even where PYTHONDONTWRITEBYTECODE is set, so that their few hundred processes compile it once.
$(VENV)/.dev-installed: requirements.txt requirements-full.txt requirements-dev.txt | $(PY)
	$(PIP) "$$(grep -m1 '^uv==' requirements-dev.txt)"
	UV_FIND_LINKS="$$($(PY) -m pip config list | sed -n "s/.*find-links='\(.*\)'/\1/p" | head -1 | tr ' ' ,)" \
		$(VENV)/bin/uv pip install -q --python $(PY) -r requirements-dev.txt
	touch $(VENV)/.installed $@

demo: $(VENV)/.installed
	@if [ -f out-rope/ckpt.pt ]; then \
		echo "out-rope already holds a trained model: sampling it (rm -r out-rope to train again)"; \
	elif $(PY) -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then \
		$(PY) train.py config/rope.py; \
	else \
		echo "no GPU: training the CPU-sized model for 1,200 iterations (config/rope.py config/cpu.py)"; \
		$(PY) train.py config/rope.py config/cpu.py --max_iters=1200 --lr_decay_iters=1200; \
	fi
	$(PY) sample.py --out_dir=out-rope --num_samples=1 --max_new_tokens=500

test: $(VENV)/.dev-installed
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n auto --dist worksteal

lint: $(VENV)/.dev-installed
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .
