"""The leaves every layer uses: errors, options, the environment, logging."""
