"""Billing: the prices, a finished request's bill, the corrections, and the one ledger of the
bills that stand."""
