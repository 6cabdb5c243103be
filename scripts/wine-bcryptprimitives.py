"""Write a bcryptprimitives.dll for Wine 8, which has none: one export, ProcessPrng, forwarded to
advapi32's SystemFunction036 (RtlGenRandom). Windows 10 and later ship the real DLL.

Rust's standard library (1.78 and later) imports ``bcryptprimitives.ProcessPrng`` on Windows, so
pydantic-core's Windows wheels (DeepSpeed needs pydantic) fail to load under Wine 8 with "DLL load
failed ... Module not found". Rust ignores ProcessPrng's result (documented to be always TRUE), so
a forwarder with RtlGenRandom's arguments (buffer, length) serves it. The DLL has no code: a PE32+
header, one section holding the export directory, and the forwarder string.

    python3 scripts/wine-bcryptprimitives.py PATH/bcryptprimitives.dll
"""
import struct
import sys

ALIGN = 0x200  # file alignment; the one section starts at this file offset
RVA = 0x1000  # and at this address in the image


def export_section() -> bytes:
    """The export directory: one named function whose address points at a forwarder string."""
    strings = [b"bcryptprimitives.dll\0", b"ProcessPrng\0", b"advapi32.SystemFunction036\0"]
    table = RVA + 40  # after the 40-byte directory: function RVA, name RVA, ordinal
    dll_name = table + 4 + 4 + 2
    fn_name = dll_name + len(strings[0])
    forward = fn_name + len(strings[1])
    directory = struct.pack("<IIHHIIIIIII", 0, 0, 0, 0, dll_name, 1, 1, 1, table, table + 4,
                            table + 8)
    body = directory + struct.pack("<IIH", forward, fn_name, 0) + b"".join(strings)
    return body


def dll() -> bytes:
    """The whole file: DOS stub header, PE headers, the section table and the section."""
    body = export_section()
    dos = b"MZ".ljust(0x3C, b"\0") + struct.pack("<I", 0x40)
    # AMD64, 1 section, optional header 240 bytes, executable | large-address-aware | DLL
    coff = struct.pack("<HHIIIHH", 0x8664, 1, 0, 0, 0, 0xF0, 0x2022)
    optional = struct.pack("<HBBIIIII", 0x20B, 14, 0, 0, ALIGN, 0, 0, 0)  # PE32+, no entry point
    optional += struct.pack("<QIIHHHHHHIIIIHHQQQQII", 0x180000000, 0x1000, ALIGN, 6, 0, 0, 0, 6,
                            0, 0, RVA + 0x1000, ALIGN, 0, 3, 0x0100, 0x100000, 0x1000, 0x100000,
                            0x1000, 0, 16)
    optional += struct.pack("<II", RVA, len(body)) + b"\0" * 8 * 15  # data directory 0: exports
    section = struct.pack("<8sIIIIIIHHI", b".rdata", ALIGN, RVA, ALIGN, ALIGN, 0, 0, 0, 0,
                          0x40000040)  # initialized data, readable
    headers = (dos + b"PE\0\0" + coff + optional + section).ljust(ALIGN, b"\0")
    return headers + body.ljust(ALIGN, b"\0")


if __name__ == "__main__":
    with open(sys.argv[1], "wb") as out:
        out.write(dll())
