"""Running distributed regimes: a warm pool of spawned worker ranks, or a launcher's process group."""
