"""ingot runtime: engine format, C++ core bindings, executor. Never imports the compiler."""
