from setuptools import find_packages, setup

setup(
    name="verl-dppo",
    version="0.1.0",
    description="DPPO (Divergence Proximal Policy Optimization) for verl: a plugin loaded by `import verl`",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",  # verl's license; the full text in LICENSE
    license_files=["LICENSE"],
    python_requires=">=3.10",
    # recipes/ (Hydra configs) and patches/ (the runtime patches of verl) live at the top of the checkout and
    # install inside the package, as verl_dppo.recipes and verl_dppo.patches.
    packages=find_packages(include=["verl_dppo", "verl_dppo.*"])
    + [
        "verl_dppo.recipes",
        "verl_dppo.recipes.setup",
        "verl_dppo.recipes.method",
        "verl_dppo.recipes.trainer_mode",
        "verl_dppo.recipes.engine_family",
        "verl_dppo.recipes.engine_settings",
        "verl_dppo.patches",
    ],
    package_dir={"verl_dppo.recipes": "recipes", "verl_dppo.patches": "patches"},
    package_data={
        "verl_dppo.rehearsal": ["isa_site/sitecustomize.py"],
        "verl_dppo.recipes": ["*.yaml", "*.md"],
        "verl_dppo.recipes.setup": ["*.yaml"],
        "verl_dppo.recipes.method": ["*.yaml"],
        "verl_dppo.recipes.trainer_mode": ["*.yaml"],
        "verl_dppo.recipes.engine_family": ["*.yaml"],
        "verl_dppo.recipes.engine_settings": ["*.yaml"],
    },
    include_package_data=True,
    install_requires=[
        "verl==0.9.1",
        "torch>=2.4",
        "omegaconf>=2.3",
        "matplotlib",
        "tqdm",
        # What verl 0.9.1's trainer, workers and agent loop import at run time but its own package does not require
        # (`verl-dppo run` fails in a Ray worker without them; `verl-dppo doctor` checks each: TRAINER_MODULES).
        "ray>=2.41",
        "cachetools",
        "fastapi",
        "uvicorn",
        "pyzmq",
        "msgspec",
        "TransferQueue>=0.1.10",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-xdist>=3.6", "ruff==0.17.6"],  # make test: ruff, then two workers
    },
    entry_points={
        # The plugin (every process of a run) and the CPU rehearsal (what runs verl on CPUs), each its own entry.
        "verl.plugins": ["dppo = verl_dppo.plugin.entry", "dppo_cpu = verl_dppo.rehearsal.entry"],
        # vLLM loads this group in each of its processes (the engine core and workers verl's server spawns): the CPU
        # rehearsal's patch of vLLM's shared-memory queues, a pass-through off the CPU platform.
        "vllm.general_plugins": ["dppo_cpu = verl_dppo.rehearsal.patches.vllm_shm_broadcast:register"],
        "console_scripts": ["verl-dppo = verl_dppo.cli:main"],
    },
)
