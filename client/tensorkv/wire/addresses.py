"""Server addresses as both ends read them: 'host:port' or '[IPv6 address]:port'."""
import ipaddress


def split_host_port(address):
    """(host without IPv6 brackets, port) of a 'host:port' address."""
    host, _, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def is_loopback(host):
    """Whether ``host`` (a name or an address, without brackets) is this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
