# Troupe: the two commands are `make demo` and `make test`; both install what is missing.
BUILD ?= build
PYTHON ?= /usr/bin/python3

.PHONY: all setup build test demo bench install clean fuzz

all: build

setup:
	@scripts/setup

# Configures once (warnings are errors), then builds incrementally.
build: setup
	@[ -f $(BUILD)/build.ninja ] || { echo "troupe: configuring $(BUILD)/; a clean build takes about 6 minutes on 2 cores ([done/total] steps below)"; meson setup $(BUILD) -Dwerror=true; }
	@ninja -C $(BUILD)

test: build
	scripts/check-layers
	scripts/typecheck
	meson test -C $(BUILD) --print-errorlogs
	$(PYTHON) -m pytest -q tests
	FUZZ_SECONDS=10 scripts/fuzz

# libFuzzer under ASan/UBSan on the parsers that read outside bytes (FUZZ_SECONDS each, default 60).
fuzz: setup
	@scripts/fuzz

demo: build
	@scripts/demo

bench: build
	@bench/run all

# Puts `troupe` on PATH (/usr/local/bin) as symlinks into the build directory.
install: build
	@scripts/install

clean:
	rm -rf $(BUILD) build-fuzz
