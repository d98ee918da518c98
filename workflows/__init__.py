"""Turn a config into a runnable job, locally or on Slurm through submitit."""
