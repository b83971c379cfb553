"""Privacy accounting: the ledgers that decide whether a release may go out."""
