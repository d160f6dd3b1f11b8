# NGC PyTorch ships CUDA, NCCL, cuDNN, Transformer Engine and apex, matched to each other.
FROM nvcr.io/nvidia/pytorch:25.12-py3

WORKDIR /opt/megatron-train
COPY pyproject.toml README.md ./
COPY megatron_train ./megatron_train
COPY models ./models
# megatron-core 0.16.1 supports Transformer Engine >= 2.9, < 2.12 (pyproject's `gpu` extra). The
# image's TE is kept when it is in that range; otherwise that range is built from source against
# the image's torch (NGC's pip constraint file pins its own TE, hence the empty PIP_CONSTRAINT).
# The last check fails the build rather than ship a TE megatron-core does not support.
ARG TE_CHECK="import sys, transformer_engine as te; v = tuple(map(int, te.__version__.split('.')[:2])); sys.exit(not (2, 9) <= v < (2, 12))"
RUN python -c "$TE_CHECK" || PIP_CONSTRAINT= NVTE_FRAMEWORK=pytorch pip install --no-cache-dir \
        --no-build-isolation "transformer-engine[pytorch]>=2.9,<2.12" \
    && python -c "$TE_CHECK"
# The base image's torch is kept: install only what it lacks, at the versions we test.
RUN pip install --no-cache-dir megatron-core==0.16.1 sentencepiece==0.2.3 datasets==5.2.0 \
        transformers==5.23.0 wandb==0.31.0 psutil==7.2.2 pyyaml==6.0.3 tqdm==4.70.1 \
    && pip install --no-cache-dir --no-deps -e .
COPY configs ./configs
COPY launch ./launch
COPY tools ./tools

ENV PYTHONUNBUFFERED=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1
