"""In-tree PEP 517 backend: setuptools, plus the CUDA-header wheel only when needed.

A machine with a CUDA toolkit builds with its headers; any other machine gets
``nvidia-cuda-runtime`` (headers only are used) added to the build requirements.
"""
from setuptools import build_meta as _orig
from setuptools.build_meta import *  # noqa: F401,F403  (re-export the PEP 517 hooks)

from cuda_headers import find_cuda_include

_HEADER_WHEEL = "nvidia-cuda-runtime"


def _extra():
    return [] if find_cuda_include(include_wheels=False) else [_HEADER_WHEEL]


def get_requires_for_build_wheel(config_settings=None):
    return _orig.get_requires_for_build_wheel(config_settings) + _extra()


def get_requires_for_build_editable(config_settings=None):
    return _orig.get_requires_for_build_editable(config_settings) + _extra()
