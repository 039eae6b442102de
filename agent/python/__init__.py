"""CPython support: struct layouts per version, `_Py_DebugOffsets`, and finding the interpreter in a process."""
