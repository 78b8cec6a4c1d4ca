#!/usr/bin/env bash
# vLLM 0.26.0 for the GPU machine (Python 3.12; its torch 2.11 is the device's), as the external baseline
# of bench/speculative.py --backend vllm. The wheel (290 MiB) travels in 52 MiB pieces, one device call
# each, like the real model (../shared/tools/device-model); its import-time needs that the device image
# lacks travel in .whl-vllm/ (~35 MiB) and .whl-vllm-xgrammar/ (43 MiB), a call each. The needs were
# found on the H100 itself (2026-12-06): importing vLLM's LLM, engine core, GPU worker and model
# runner, n-gram proposer and Qwen2 model there, then starting an engine, one missing module at a time; the device has the rest (torch,
# transformers, triton, numpy, aiohttp, jsonschema...: /work/.library/device/KINDS.md). Pins that
# matter: openai < 3 (3.x imports httpx2), xgrammar 0.2.2 (later ones need apache-tvm-ffi >= 0.1.11;
# vLLM pins 0.1.10). Run from the project root:
#   bash bench/vllm_wheels.sh
# then device calls with carry [".whl-vllm"], then [".whl-vllm-xgrammar"] (mkdir -p /tmp/whl-vllm /tmp/vasm;
# cp .whl-vllm*/* /tmp/whl-vllm/), and
# per piece one with carry [".xfer-vllm-NN"] (cp .xfer-vllm-NN/* /tmp/vasm/), back to back (the machine
# goes back after 30 s idle, and /tmp with it)
# and once all are there:
#   cat /tmp/vasm/v* > /tmp/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vllm-site \
#     /tmp/vllm-0.26.0-*.whl /tmp/whl-vllm/*.whl
#   PYTHONPATH=/tmp/vllm-site:... VLLM_USE_FLASHINFER_SAMPLER=0 python bench/speculative.py --backend vllm ...
set -euo pipefail
CACHE=${DEVICE_MODEL_CACHE:-$HOME/.cache/hybridflow-assets}/vllm
# (vLLM pins llguidance 1.7, which the registry does not have: 1.6.1, imported only)
NEEDS="cbor2 pyzmq openai-harmony msgspec pybase64 cachetools llguidance xgrammar==0.2.2 apache-tvm-ffi==0.1.10
  partial-json-parser pydantic>=2.12 annotated-types typing-inspection blake3 depyf==0.20.0 astor lark==1.2.2
  outlines_core==0.2.14 compressed-tensors==0.17.0 setproctitle python-json-logger watchfiles ijson
  openai>=2,<3 jiter distro sniffio fastapi<0.137,>=0.133 starlette>=1.0.1 prometheus-fastapi-instrumentator
  lm-format-enforcer==0.11.3 interegular mistral_common>=1.11.5 pycountry pydantic-extra-types anthropic
  docstring-parser prometheus-client"
mkdir -p "$CACHE" .whl-vllm
for f in .whl-vllm .whl-vllm-xgrammar .xfer-vllm-*; do grep -qx "/$f/" .git/info/exclude 2>/dev/null || echo "/$f/" >> .git/info/exclude; done
grep -qx '/.xfer-vllm-\*/' .git/info/exclude || echo '/.xfer-vllm-*/' >> .git/info/exclude
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$1" "$2" 2>&1 | grep -v '^WARNING: Location' || true
}
ls "$CACHE"/vllm-0.26.0-*.whl >/dev/null 2>&1 || download "$CACHE" vllm==0.26.0
for need in $NEEDS; do download .whl-vllm "$need"; done
# pydantic pins its core exactly: the core it names
core=$(unzip -p .whl-vllm/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
download .whl-vllm "pydantic-core==$core"
rm -rf .whl-vllm-xgrammar && mkdir .whl-vllm-xgrammar && mv .whl-vllm/xgrammar-*.whl .whl-vllm-xgrammar/  # (43 MiB)
rm -rf .xfer-vllm-*
tmp=$(mktemp -d)
split -b 52M -d -a 2 "$CACHE"/vllm-0.26.0-*.whl "$tmp/v"
for piece in "$tmp"/v*; do
  n=${piece##*/v}; mkdir -p ".xfer-vllm-$n"; mv "$piece" ".xfer-vllm-$n/"
done
rm -rf "$tmp"
echo "$(ls -d .xfer-vllm-* | wc -l) pieces of the vLLM wheel in .xfer-vllm-NN/; its needs in .whl-vllm/ ($(du -sh .whl-vllm | cut -f1))"
