"""``streamtally audit --provider-usage``: the provider's own usage report against the ledger.

The audit proves each bill from the raw topics; a call that never reached them (the tap
missed it, or it was dropped) is invisible to it.  The provider's usage report is the one
independent record of such calls.  This package reads the reports (`_parse`: OpenAI's
organization Usage API completions buckets, Anthropic's Admin API messages usage report, a
plain CSV), maps their API keys, projects or workspaces to tenants (`_tenants`), reads the
bills that stand as of the audit's snapshot (`_read`) and compares the totals per (UTC day,
model, tenant) and token kind (`_compare`): a difference beyond the tolerance is a
``provider_usage_mismatch`` discrepancy, with the provider's count and the ledger's.
"""

from __future__ import annotations

from streamtally.audit.provider_usage._compare import ProviderCheck, Tolerance, compare_usage
from streamtally.audit.provider_usage._parse import (
    ANTHROPIC,
    CSV,
    KINDS,
    OPENAI,
    PROVIDER_KINDS,
    ProviderReport,
    UsageLine,
    load_reports,
    parse_anthropic,
    parse_csv,
    parse_openai,
)
from streamtally.audit.provider_usage._read import snapshot_ranges, standing_bills
from streamtally.audit.provider_usage._tenants import TenantMap

__all__ = [
    "ANTHROPIC",
    "CSV",
    "KINDS",
    "OPENAI",
    "PROVIDER_KINDS",
    "ProviderCheck",
    "ProviderReport",
    "TenantMap",
    "Tolerance",
    "UsageLine",
    "compare_usage",
    "load_reports",
    "parse_anthropic",
    "parse_csv",
    "parse_openai",
    "snapshot_ranges",
    "standing_bills",
]
