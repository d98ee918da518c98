# Two entry points: `make demo` (set up and run the main job) and `make test` (set up and run the tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_DIR ?= demo
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check

# The image (containers/README.md): the offline base from Debian's packages and PyPI wheels, then vitctl's image on it.
IMAGE_TAG ?= localhost/vitctl:latest
IMAGE_BASE ?= localhost/vitctl-base:torch2.11.0
IMAGE_OUT ?= build/image
IMAGE_ARCHS ?= 8.0;9.0;10.0
APEX_ARCHIVE ?= $(wildcard ../shared/vendor/apex-*.tar.gz)

.PHONY: demo test lint bench clean-demo image image-test

# A rerun of the demo goes on from its runs' checkpoints; a first run has none to go on from (make expands a recipe
# before running it, so this sees the folders as they were when `make demo` began).
resume_if_there = $(if $(wildcard $(1)),--resume)

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) -e '.[dali,test]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/vitctl data synth $(DEMO_DIR)/archives --classes 10 --train-per-class 40 --val-per-class 10
	$(BIN)/vitctl data extract --train-tar $(DEMO_DIR)/archives/ILSVRC2012_img_train.tar \
		--val-tar $(DEMO_DIR)/archives/ILSVRC2012_img_val.tar --out $(DEMO_DIR)/imagenet
	$(BIN)/vitctl data valprep $(DEMO_DIR)/imagenet/val --devkit $(DEMO_DIR)/archives/ILSVRC2012_devkit_t12.tar.gz
	$(BIN)/vitctl data shard $(DEMO_DIR)/imagenet --out $(DEMO_DIR)/shards --maxcount 128
	$(BIN)/vitctl data index $(DEMO_DIR)/shards
	$(BIN)/vitctl data verify $(DEMO_DIR)/shards --decode 64
	$(BIN)/vitctl train --config demo_vit --data $(DEMO_DIR)/shards --out $(DEMO_DIR)/runs/pretrain \
		$(call resume_if_there,$(DEMO_DIR)/runs/pretrain) --executor local --gpus 0
	$(BIN)/vitctl finetune --config demo_vit --data $(DEMO_DIR)/shards --out $(DEMO_DIR)/runs/finetune \
		$(call resume_if_there,$(DEMO_DIR)/runs/finetune) --executor local --gpus 0 \
		--from-ckpt $(DEMO_DIR)/runs/pretrain \
		--epochs 3 --set model.img_size=48 --set optim.warmup_epochs=0
	$(BIN)/vitctl status
	@echo "vitctl is installed in $(BIN): 'source $(BIN)/activate' puts it on PATH"

test: $(BIN)/.installed
	$(BIN)/ruff check .
	slurm/dev-cluster/up
	containers/install-tools
	$(BIN)/python -m pytest -m "not gpu"

bench: $(BIN)/.installed
	$(BIN)/python bench/bench_data.py

# The job list's runs in the demo's folder leave it first: forget refuses a job that still runs, and then nothing is
# removed. (Run folders the list does not hold, as another VITCTL_HOME's, are only removed.)
clean-demo:
	if [ -x $(BIN)/vitctl ]; then $(BIN)/vitctl jobs | awk -F '\t' -v demo="$(abspath $(DEMO_DIR))/" \
		'NR > 1 && index($$4, demo) == 1 { print $$4 }' | sort -u | xargs -r -d '\n' $(BIN)/vitctl forget; fi
	@echo "removing $(DEMO_DIR)/: the demo's archives, images, shards and runs (forget only took its jobs off the list)"
	rm -rf $(DEMO_DIR)

image: $(BIN)/.installed
	containers/install-tools
	WORK=$(IMAGE_OUT) containers/base/build-base $(IMAGE_BASE)
	$(BIN)/vitctl image build --base $(IMAGE_BASE) --tag $(IMAGE_TAG) --out $(IMAGE_OUT) --arch-list '$(IMAGE_ARCHS)' \
		$(if $(APEX_ARCHIVE),--apex $(APEX_ARCHIVE))

image-test:
	containers/image-test $(IMAGE_TAG) $(IMAGE_OUT)/$(subst :,-,$(notdir $(IMAGE_TAG))).sqsh
