"""The `vitctl` command line: parses arguments and prints; the work lives in the other packages."""
