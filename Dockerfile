# JupyterLab with the labs, PyTorch on CUDA and Horovod (NCCL, MPI, Gloo).
#
#   docker build -t lab-suite .
#   docker run --gpus all --rm -p 8888:8888 --shm-size=1g lab-suite
#
# The base is pinned because Horovod is compiled below against the image's own
# torch, CUDA and NCCL: a moving tag would change what the wheel links against
# under an unchanged Dockerfile. 24.10 ships PyTorch 2.5, CUDA 12.6 and Python
# 3.10 on Ubuntu 22.04. NGC images do not include Horovod.
FROM nvcr.io/nvidia/pytorch:24.10-py3

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The same Debian packages as scripts/setup.sh installs (APT_PACKAGES there).
# The image's own OpenMPI comes first on PATH, so Horovod is built and run with it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        openmpi-bin libopenmpi-dev dataset-fashion-mnist make cmake g++ bubblewrap openjdk-17-jre-headless iproute2 \
    && rm -rf /var/lib/apt/lists/*

# Keep the image's torch whatever pip resolves below. NGC images from 25.03 on
# already point PIP_CONSTRAINT at /etc/pip/constraint.txt (every preinstalled
# package pinned); that file stays in force next to this one.
RUN python -c "import torch; print('torch==' + torch.__version__)" > /etc/pip-keep-torch.txt
ENV PIP_CONSTRAINT="/etc/pip-keep-torch.txt ${PIP_CONSTRAINT}"

WORKDIR /workspace/lab-suite

# Horovod first: the 5-10 minute build stays cached while the labs change.
# build_horovod.sh holds the build flags (PyTorch, MPI, Gloo on, TensorFlow and
# MXNet off); the image adds NCCL. It fails unless horovodrun --check-build
# shows PyTorch, MPI, Gloo and NCCL.
COPY scripts/build_horovod.sh scripts/build_horovod.sh
RUN HOROVOD_GPU_OPERATIONS=NCCL bash scripts/build_horovod.sh

# The package with the JupyterLab extras; --no-build-isolation so the build
# uses the image's setuptools under the same constraints.
COPY . .
RUN pip install "setuptools>=64" \
    && pip install --no-build-isolation -e '.[lab,spark]' \
    && mkdir -p "$(python -c 'import sys; print(sys.prefix)')/share/jupyter/lab/settings" \
    && cp scripts/jupyterlab-overrides.json \
        "$(python -c 'import sys; print(sys.prefix)')/share/jupyter/lab/settings/overrides.json"

# The image runs as root; OpenMPI needs these to start as root, and to start
# more ranks than cores.
ENV OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    OMPI_MCA_rmaps_base_oversubscribe=1

EXPOSE 8888
CMD ["jupyter", "lab", "--ip=0.0.0.0", "--port=8888", "--no-browser", "--allow-root", "--notebook-dir=labs"]
