"""Upstream's seeding helper (same name and effect)."""

import random

import numpy as np
import torch


def set_all_random_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
