"""``warpforge profile``: where a model's time goes, against the roofline of the measured ceilings.

``profile(fn, *inputs)`` warms up, counts FLOPs and bytes per operator (a dispatch-mode counter),
captures measured windows with the PyTorch profiler (Kineto; NVTX ranges named by module path on CUDA;
on a GPU a detail window names the operators and a light, CUDA-only one gives the times), maps kernels
to the operators that launched them, places each on the roofline, splits the window's time, and writes
findings. ``Profile.write(dir)`` gives JSON and a self-contained HTML report; ``compare(a, b)`` shows
what moved between two profiles. ``profile_train(TrainSetup(...))`` splits whole training steps
(loader, copies, forward, backward, optimizer, collectives, memory).
"""

from warpforge.profile.api import Profile, profile
from warpforge.profile.compare import compare
from warpforge.profile.flops import Counts, FlopCounter, OpCount, count
from warpforge.profile.trace import ProfileError
from warpforge.profile.train import TrainConfig, TrainSetup
from warpforge.profile.train_run import profile_train

__all__ = ["Counts", "FlopCounter", "OpCount", "Profile", "ProfileError", "TrainConfig", "TrainSetup", "compare",
           "count", "profile", "profile_train"]
