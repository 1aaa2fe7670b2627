"""Lists of networks (``--trusted-proxies``): read and checked one way, each entry an address
or a network in CIDR form. Standard library only: the settings' check lives here.
"""

from __future__ import annotations

import ipaddress

from cosyvoice_lb.common.checks import parsed_by

EXAMPLE = "10.0.0.0/8 or 192.168.1.7"


def parse_networks(value: str) -> list[str]:
    """``10.0.0.0/8, 192.168.1.7`` -> ``["10.0.0.0/8", "192.168.1.7/32"]`` (each network in
    its normal form, once); a ValueError naming the entry that is neither."""
    found: list[str] = []
    for item in filter(None, (part.strip() for part in str(value).split(","))):
        try:
            network = str(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"{item!r} is not an address or a network in CIDR form (e.g. {EXAMPLE})") from None
        if network not in found:
            found.append(network)
    return found


# The settings' check: what is wrong with a comma-separated list of networks ("" when nothing).
networks = parsed_by(parse_networks)
