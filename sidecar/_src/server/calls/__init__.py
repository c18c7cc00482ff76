"""Running registered code for a caller: unary calls, and streams and feeds with their credits."""
