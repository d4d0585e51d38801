"""Capture kernels: writing a step's routing into the slot table, gathering a request's rows.

``reference`` holds the torch implementations that define the semantics.
"""

from .reference import gather_rows, table_dtype, write_step_rows

__all__ = ["gather_rows", "table_dtype", "write_step_rows"]
