from setuptools import find_packages, setup

setup(
    name="verl-dppo",
    version="0.1.0",
    description="DPPO (Divergence Proximal Policy Optimization) for verl: a plugin loaded by `import verl`",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # The recipes live in recipes/ at the top of the checkout and install as verl_dppo.recipes (Hydra configs).
    packages=find_packages(include=["verl_dppo", "verl_dppo.*"])
    + ["verl_dppo.recipes", "verl_dppo.recipes.setup", "verl_dppo.recipes.method"],
    package_dir={"verl_dppo.recipes": "recipes"},
    package_data={
        "verl_dppo.recipes": ["*.yaml", "*.md"],
        "verl_dppo.recipes.setup": ["*.yaml"],
        "verl_dppo.recipes.method": ["*.yaml"],
    },
    include_package_data=True,
    install_requires=[
        "verl==0.9.1",
        "torch>=2.4",
        "omegaconf>=2.3",
        "matplotlib",
        "tqdm",
    ],
    extras_require={
        # verl's "verl-core" pieces that its worker, agent-loop and trainer modules import (CPU-installable).
        "test": [
            "pytest>=8",
            "ray>=2.41",
            "cachetools",
            "fastapi",
            "uvicorn",
            "pyzmq",
            "msgspec",
            "TransferQueue>=0.1.10",
        ],
    },
    entry_points={
        "verl.plugins": ["dppo = verl_dppo.adapter.plugin"],
        "console_scripts": ["verl-dppo = verl_dppo.cli:main"],
    },
)
