//! Protobuf at the wire level: the outer `Trace` framing and the fields of one message, read without a
//! schema (`merge` rewrites a few fields and passes every other byte through untouched).

use prost::encoding::decode_varint;

/// One field of a message.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value<'a> {
    /// Wire type 0.
    Varint(u64),
    /// Wire type 1.
    Fixed64(u64),
    /// Wire type 2: a string, bytes or a nested message.
    Bytes(&'a [u8]),
    /// Wire type 5.
    Fixed32(u32),
}

impl<'a> Value<'a> {
    /// The integer in a varint or fixed field.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::Varint(v) | Value::Fixed64(v) => Some(v),
            Value::Fixed32(v) => Some(u64::from(v)),
            Value::Bytes(_) => None,
        }
    }

    /// The bytes of a length-delimited field.
    pub fn as_bytes(&self) -> Option<&'a [u8]> {
        match *self {
            Value::Bytes(b) => Some(b),
            _ => None,
        }
    }

    /// A length-delimited field as UTF-8 text (lossy).
    pub fn as_str(&self) -> Option<String> {
        self.as_bytes().map(|b| String::from_utf8_lossy(b).into_owned())
    }
}

/// A malformed message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WireError(pub String);

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The fields of one message, in order: `(field number, value, the field's whole encoding)`.
pub fn fields(msg: &[u8]) -> Fields<'_> {
    Fields { msg, pos: 0 }
}

/// Iterator of [`fields`].
pub struct Fields<'a> {
    msg: &'a [u8],
    pos: usize,
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u32, Value<'a>, &'a [u8]), WireError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.pos >= self.msg.len() {
            return None;
        }
        let start = self.pos;
        let mut rest = &self.msg[self.pos..];
        let before = rest.len();
        let key = match decode_varint(&mut rest) {
            Ok(k) => k,
            Err(e) => {
                self.pos = self.msg.len();
                return Some(Err(WireError(format!("bad field key at byte {start}: {e}"))));
            }
        };
        let number = (key >> 3) as u32;
        let value = match key & 7 {
            0 => decode_varint(&mut rest).map(Value::Varint).map_err(|e| e.to_string()),
            1 if rest.len() >= 8 => {
                let v = u64::from_le_bytes(rest[..8].try_into().expect("8 bytes"));
                rest = &rest[8..];
                Ok(Value::Fixed64(v))
            }
            5 if rest.len() >= 4 => {
                let v = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes"));
                rest = &rest[4..];
                Ok(Value::Fixed32(v))
            }
            2 => match decode_varint(&mut rest) {
                Ok(len) if (len as usize) <= rest.len() => {
                    let (b, r) = rest.split_at(len as usize);
                    rest = r;
                    Ok(Value::Bytes(b))
                }
                Ok(len) => Err(format!("field {number} claims {len} bytes, {} left", rest.len())),
                Err(e) => Err(e.to_string()),
            },
            t => Err(format!("field {number}: unsupported or cut wire type {t}")),
        };
        match value {
            Ok(v) => {
                self.pos += before - rest.len();
                Some(Ok((number, v, &self.msg[start..self.pos])))
            }
            Err(e) => {
                self.pos = self.msg.len();
                Some(Err(WireError(format!("at byte {start}: {e}"))))
            }
        }
    }
}

/// The packets of a trace file: byte ranges of each `TracePacket`'s body, and where a cut tail starts (the
/// file ends inside a packet) if it does.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Framing {
    /// `(start, end)` of each whole packet's body.
    pub packets: Vec<(usize, usize)>,
    /// The byte offset of a last packet the file cuts short, if any.
    pub cut_at: Option<usize>,
}

/// Reads the file at `path` whole, having first looked at its first packet's key: a file that does not start
/// like a Perfetto trace (a disk image, a multi-GB file of zeros) is refused without being read into memory.
pub fn read_trace_bytes(path: &std::path::Path) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).map_err(|e| format!("cannot read: {e}"))?;
    let mut first = [0u8; 1];
    let n = file.read(&mut first).map_err(|e| format!("cannot read: {e}"))?;
    if n == 1 && first[0] != (1 << 3 | 2) {
        return Err(format!(
            "byte 0: field key {} is not a Trace.packet: not a Perfetto protobuf trace",
            first[0]
        ));
    }
    let mut data = first[..n].to_vec();
    file.read_to_end(&mut data).map_err(|e| format!("cannot read: {e}"))?;
    Ok(data)
}

/// Splits a trace into packets. A file that ends inside a packet (a killed process) yields its whole
/// packets and `cut_at`, and so does one whose whole packets are followed by nothing but zero bytes (a file
/// system that extended the file after a crash without its data: a classic of delayed allocation); anything
/// else malformed is an error.
pub fn framing(data: &[u8]) -> Result<Framing, WireError> {
    let mut out = Framing::default();
    let mut pos = 0;
    while pos < data.len() {
        if !out.packets.is_empty() && data[pos] == 0 && data[pos..].iter().all(|&b| b == 0) {
            out.cut_at = Some(pos);
            break;
        }
        let mut rest = &data[pos..];
        let key = match decode_varint(&mut rest) {
            Ok(k) => k,
            Err(_) if data.len() - pos < 10 => {
                out.cut_at = Some(pos);
                break;
            }
            Err(e) => return Err(WireError(format!("bad packet key at byte {pos}: {e}"))),
        };
        if key != (1 << 3 | 2) {
            return Err(WireError(format!(
                "byte {pos}: field key {key} is not a Trace.packet: not a Perfetto protobuf trace"
            )));
        }
        let len = match decode_varint(&mut rest) {
            Ok(l) => l as usize,
            Err(_) => {
                out.cut_at = Some(pos);
                break;
            }
        };
        let body = data.len() - rest.len();
        if len > rest.len() {
            out.cut_at = Some(pos);
            break;
        }
        out.packets.push((body, body + len));
        pos = body + len;
    }
    Ok(out)
}

/// Appends a varint field.
pub fn put_varint(buf: &mut Vec<u8>, number: u32, value: u64) {
    prost::encoding::encode_key(number, prost::encoding::WireType::Varint, buf);
    prost::encoding::encode_varint(value, buf);
}

/// Appends a length-delimited field.
pub fn put_bytes(buf: &mut Vec<u8>, number: u32, bytes: &[u8]) {
    prost::encoding::encode_key(number, prost::encoding::WireType::LengthDelimited, buf);
    prost::encoding::encode_varint(bytes.len() as u64, buf);
    buf.extend_from_slice(bytes);
}

/// Appends a fixed64 field.
pub fn put_fixed64(buf: &mut Vec<u8>, number: u32, value: u64) {
    prost::encoding::encode_key(number, prost::encoding::WireType::SixtyFourBit, buf);
    buf.extend_from_slice(&value.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whole packets then zeros (a crash's zero-filled tail): read up to the zeros, which are the cut. Zeros
    /// before any packet, or junk that is not all zeros, are still errors.
    #[test]
    fn a_zero_filled_tail_is_a_cut() {
        let mut data = Vec::new();
        for n in 0..3u64 {
            let mut packet = Vec::new();
            put_varint(&mut packet, 8, n + 1);
            put_bytes(&mut data, 1, &packet);
        }
        let whole = data.len();
        data.extend_from_slice(&[0; 4096]);
        let f = framing(&data).unwrap();
        assert_eq!((f.packets.len(), f.cut_at), (3, Some(whole)));
        assert!(framing(&[0; 64]).is_err());
        let mut junk = data[..whole].to_vec();
        junk.extend_from_slice(&[0, 0, 7, 0]);
        assert!(framing(&junk).is_err());
    }

    #[test]
    fn framing_stops_at_a_cut_packet_at_every_byte() {
        let mut trace = Vec::new();
        for i in 0..20u64 {
            let mut packet = Vec::new();
            put_varint(&mut packet, 8, 1_000 + i);
            put_bytes(&mut packet, 23, &vec![b'x'; (i * 13) as usize]);
            put_bytes(&mut trace, 1, &packet);
        }
        let whole = framing(&trace).unwrap();
        assert_eq!(whole.packets.len(), 20);
        assert_eq!(whole.cut_at, None);
        for cut in 0..trace.len() {
            let f = framing(&trace[..cut]).unwrap();
            let complete = whole.packets.iter().filter(|(_, end)| *end <= cut).count();
            assert_eq!(f.packets.len(), complete, "cut at {cut}");
            assert_eq!(
                f.cut_at.is_some(),
                !whole.packets.iter().any(|(_, end)| *end == cut) && cut > 0
            );
        }
    }

    #[test]
    fn fields_read_back_what_was_written() {
        let mut m = Vec::new();
        put_varint(&mut m, 1, 300);
        put_fixed64(&mut m, 47, 7);
        put_bytes(&mut m, 23, b"name");
        let got: Vec<_> = fields(&m).map(|f| f.unwrap()).map(|(n, v, _)| (n, v)).collect();
        assert_eq!(
            got,
            vec![
                (1, Value::Varint(300)),
                (47, Value::Fixed64(7)),
                (23, Value::Bytes(b"name"))
            ]
        );
        assert!(fields(&m[..m.len() - 1]).any(|f| f.is_err()));
        assert!(framing(b"not a trace at all").is_err());
    }
}
