#!/usr/bin/env bash
# vLLM 0.26.0 for the GPU machine (Python 3.12; its torch 2.11 is the device's), as the external baseline
# of bench/speculative.py --backend vllm. The wheel (290 MiB) travels in 52 MiB pieces, one device call
# each, like the real model (../shared/tools/device-model); its import-time needs that the device image
# lacks travel in .whl-vllm/ with the first piece. The needs were found here by importing vllm's LLM,
# engine core, GPU worker and model runner, n-gram and suffix proposers and Qwen2 model from the
# unpacked wheel, installing each missing module in turn; the device has the rest (cloudpickle,
# aiohttp, numba, einops...: /work/.library/device/KINDS.md). Run from the project root:
#   bash bench/vllm_wheels.sh
# then per piece a device call with carry [".xfer-vllm-NN"] (the first also ".whl-vllm"):
#   mkdir -p /tmp/vasm && cp .xfer-vllm-NN/* /tmp/vasm/
# and once all are there:
#   cat /tmp/vasm/v* > /tmp/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vllm-site \
#     /tmp/vllm-0.26.0-*.whl .whl-vllm/*.whl   # (copy .whl-vllm to /tmp first: later calls drop it)
#   PYTHONPATH=/tmp/vllm-site:... VLLM_USE_FLASHINFER_SAMPLER=0 python bench/speculative.py --backend vllm ...
set -euo pipefail
CACHE=${DEVICE_MODEL_CACHE:-$HOME/.cache/hybridflow-assets}/vllm
# (vLLM pins llguidance 1.7, which the registry does not have: 1.6.1, imported only)
NEEDS="cbor2 pyzmq openai-harmony msgspec pybase64 cachetools llguidance xgrammar apache-tvm-ffi==0.1.10 partial-json-parser"
mkdir -p "$CACHE" .whl-vllm
for f in .whl-vllm .xfer-vllm-*; do grep -qx "/$f/" .git/info/exclude 2>/dev/null || echo "/$f/" >> .git/info/exclude; done
grep -qx '/.xfer-vllm-\*/' .git/info/exclude || echo '/.xfer-vllm-*/' >> .git/info/exclude
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$1" "$2" 2>&1 | grep -v '^WARNING: Location' || true
}
ls "$CACHE"/vllm-0.26.0-*.whl >/dev/null 2>&1 || download "$CACHE" vllm==0.26.0
for need in $NEEDS; do download .whl-vllm "$need"; done
rm -rf .xfer-vllm-*
tmp=$(mktemp -d)
split -b 52M -d -a 2 "$CACHE"/vllm-0.26.0-*.whl "$tmp/v"
for piece in "$tmp"/v*; do
  n=${piece##*/v}; mkdir -p ".xfer-vllm-$n"; mv "$piece" ".xfer-vllm-$n/"
done
rm -rf "$tmp"
echo "$(ls -d .xfer-vllm-* | wc -l) pieces of the vLLM wheel in .xfer-vllm-NN/; its needs in .whl-vllm/ ($(du -sh .whl-vllm | cut -f1))"
