"""Admission stages of the gateway (pure Python, no aiohttp, no import-time side effects).

Submodules are imported where they are used, e.g.
``from kvgate.admission.wait_queue import PriorityWaitQueue``.
"""
