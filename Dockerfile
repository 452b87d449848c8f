# GPU image: PyTorch with CUDA from the official PyTorch wheels, then this framework.
#   docker build -t megatron-lite .
#   docker run --gpus all --ipc=host -v /data:/data megatron-lite \
#       torchrun --nproc_per_node 8 pretrain_gpt.py ...
# For a CPU-only image: docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
RUN apt-get update && apt-get install -y --no-install-recommends gcc && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir "torch>=2.11,<2.15" --index-url "$TORCH_INDEX"
WORKDIR /workspace/megatron-lite
COPY . .
RUN pip install --no-cache-dir -e ".[test]"
CMD ["bash", "examples/quickstart.sh"]
