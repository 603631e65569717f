"""What the tests and the benchmark studies share: random models that pdserve serves, and hosts as
network namespaces. Nothing that serves imports this package (an import-linter contract)."""
