#!/usr/bin/env bash
# How the vLLM these measurements ran on was put together: vLLM 0.22.0's CUDA wheel and the packages
# it needs that a lent GPU machine (Python 3.12, torch 2.11.0+cu130, no package index) lacks,
# trimmed and packed into parts small enough to carry (the device tool moves at most 64 MiB a call).
#
#   bash carry_vllm.sh OUT_DIR HAVE_FILE [PYTHON3.12]
#
# HAVE_FILE lists the packages the target already has, one name per line (for the lent machines:
# the "Packages:" line of the device library's KINDS.md, split at commas). Writes OUT_DIR/site.tar.xz
# (131 MB here), its sha256 and three parts. On the target:
#   cat part.* > site.tar.xz && xz -dc site.tar.xz | tar -x -C /tmp
#   export PYTHONPATH=/tmp/site:$REPO    # then run planner profile --engine cuda as in README.md
set -euo pipefail
out=$(realpath -m "$1"); have=$(realpath "$2"); py=${3:-python3.12}
venv="$out/venv"
mkdir -p "$out"
"$py" -m venv "$venv"
"$venv/bin/pip" install -q "vllm==0.22.0"
# Kernels and backends an 8B dense model with LoRA on an H100 does not load (FlashInfer: its sampler is
# switched off by the harness; attention runs on FA3, which the wheel carries).
"$venv/bin/pip" uninstall -q -y flashinfer-cubin flashinfer-python tokenspeed-triton nvidia-cutlass-dsl-libs-cu13 \
  nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl tilelang nvidia-nvvm nvidia-cuda-nvcc z3-solver nvidia-cuda-cccl \
  fastsafetensors nvidia-cudnn-frontend cuda-tile quack-kernels tokenspeed-mla humming-kernels torch-c-dlpack-ext \
  nvidia-cuda-crt cuda-python sentry-sdk fastar rignore supervisor outlines-core
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -f "$site"/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$site"/vllm/_moe_C.abi3.so "$site"/vllm/vllm-rs \
  "$site"/vllm/_flashmla*.so "$site"/vllm/third_party/deep_gemm/_C.cpython-31[0134]*.so
# vLLM imports these at start-up; only their data (locales, a static library, Mistral vocabularies) goes.
rm -rf "$site"/pycountry/locales "$site"/xgrammar/lib/*.a "$site"/mistral_common/data/tekken_*.json
# Every installed distribution the target lacks, and vLLM's own transformers/tokenizers/hub versions
# (the target's newer ones are not what vLLM 0.22 was built against), copied file by file.
"$venv/bin/python" - "$site" "$have" "$out/site" <<'EOF'
import importlib.metadata as md, os, shutil, sys
site, have_file, dest = sys.argv[1:]
norm = lambda s: s.strip().lower().replace("_", "-")
have = {norm(x) for x in open(have_file) if x.strip()} - {"transformers", "tokenizers", "huggingface-hub"}
names = []
for d in md.distributions(path=[site]):
    if norm(d.metadata["Name"]) in have | {"pip"}:
        continue
    names.append(f"{norm(d.metadata['Name'])}=={d.version}")
    for f in d.files or []:
        src = str(d.locate_file(f))
        if "__pycache__" in src or not os.path.isfile(src):
            continue
        dst = os.path.join(dest, os.path.relpath(src, site))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(src, dst)
open(os.path.join(dest, "CARRIED.txt"), "w").write("\n".join(sorted(names)) + "\n")
EOF
tar -C "$out" -cf - site | xz -T0 -6 > "$out/site.tar.xz"
(cd "$out" && sha256sum site.tar.xz > site.sha && split -n 3 -d site.tar.xz part.)
ls -la "$out"
