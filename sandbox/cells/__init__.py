"""Code that runs inside a kernel, not in this process: each module here is a cell's source, read
as text by ``stare_sandbox.kernel`` and sent to the kernel (or to the Docker warden, which runs the boot
cells in each kernel before it serves), where it runs in a namespace of its own (``exec(source, {})``)
followed by one call of its function.

They are real modules so that ruff and mypy read them; nothing in this package imports them. Each
may import only what a sandbox kernel has: the standard library and IPython.
"""
