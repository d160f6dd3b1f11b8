# NGC PyTorch ships CUDA, NCCL, Transformer Engine and apex, matched to each other.
FROM nvcr.io/nvidia/pytorch:25.04-py3

WORKDIR /opt/megatron-train
COPY pyproject.toml README.md ./
COPY megatron_train ./megatron_train
COPY models ./models
# The base image's torch and TE are kept: install only what it lacks, at the versions we test.
RUN pip install --no-cache-dir megatron-core==0.16.1 sentencepiece==0.2.3 datasets==5.2.0 \
        transformers==5.23.0 wandb==0.31.0 psutil==7.2.2 pyyaml==6.0.3 tqdm==4.70.1 \
    && pip install --no-cache-dir --no-deps -e .
COPY configs ./configs
COPY launch ./launch
COPY tools ./tools

ENV PYTHONUNBUFFERED=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1
