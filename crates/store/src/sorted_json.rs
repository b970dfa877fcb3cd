//! A step trace's stored JSON written in one pass: the text
//! `serde_json::to_value` and then `serde_json::to_string` make (every
//! object's keys in byte order, as `serde_json::Value`'s map keeps them),
//! with the contents a store keeps apart replaced by their hash as they
//! are written, without building the `Value` tree first.

use std::borrow::Cow;
use std::fmt::Display;

use serde::Serialize;
use serde::ser::{self, Impossible};

/// Why a value could not be written.
#[derive(Debug)]
pub(crate) struct Error(String);

impl Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

impl ser::Error for Error {
    fn custom<T: Display>(msg: T) -> Self {
        Error(msg.to_string())
    }
}

/// One step of the path from the trace to the value being written.
#[derive(Debug)]
enum Segment {
    Key(Cow<'static, str>),
    Index,
}

/// The writer: the text so far, where it is in the trace, and the kept
/// contents found.
#[derive(Debug, Default)]
pub(crate) struct Encoder {
    out: Vec<u8>,
    path: Vec<Segment>,
    /// Each kept content: its hash and its JSON, in the order first met.
    blobs: Vec<(String, String)>,
    /// Reused to reorder an object's entries.
    scratch: Vec<u8>,
}

/// `value` as `serde_json::to_string(&serde_json::to_value(value)?)` writes
/// it, each content at one of `kept`'s paths replaced by
/// `{"$content": <hash>}` (see [`crate::EncodedTrace`]), and those
/// contents.
pub(crate) fn encode<T: Serialize + ?Sized>(
    value: &T,
) -> Result<(String, Vec<(String, String)>), Error> {
    let mut encoder = Encoder::default();
    value.serialize(&mut encoder)?;
    let text = String::from_utf8(encoder.out).map_err(|e| Error(e.to_string()))?;
    Ok((text, encoder.blobs))
}

impl Encoder {
    /// Whether the value about to be written is a content kept apart: a
    /// model call's `system`, `tools` or `view.summary`, the step's own
    /// calls or those of the sub-agent steps it holds.
    fn at_kept(&self) -> bool {
        let key = |s: &Segment, want: &str| matches!(s, Segment::Key(k) if k == want);
        let call_field = |rest: &[Segment]| match rest {
            [Segment::Index, field] => key(field, "system") || key(field, "tools"),
            [Segment::Index, view, summary] => key(view, "view") && key(summary, "summary"),
            _ => false,
        };
        match self.path.as_slice() {
            [calls, rest @ ..] if key(calls, "calls") => call_field(rest),
            [subs, Segment::Index, step, calls, rest @ ..] if key(subs, "sub_agents") => {
                key(step, "step") && key(calls, "calls") && call_field(rest)
            }
            _ => false,
        }
    }

    /// Writes `value` at the current path: as it is, or, at a kept
    /// content's path, as the hash that names it.
    fn value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        if !self.at_kept() {
            return value.serialize(&mut *self);
        }
        let start = self.out.len();
        // The content's own path is not a kept one: nothing inside it is
        // replaced.
        let path = std::mem::take(&mut self.path);
        let written = value.serialize(&mut *self);
        self.path = path;
        written?;
        let text =
            String::from_utf8(self.out.split_off(start)).map_err(|e| Error(e.to_string()))?;
        let hash = crate::content_hash(&text);
        self.out.extend_from_slice(b"{\"");
        self.out.extend_from_slice(crate::BLOB_KEY.as_bytes());
        self.out.extend_from_slice(b"\":\"");
        self.out.extend_from_slice(hash.as_bytes());
        self.out.extend_from_slice(b"\"}");
        if !self.blobs.iter().any(|(h, _)| *h == hash) {
            self.blobs.push((hash, text));
        }
        Ok(())
    }

    fn string(&mut self, s: &str) -> Result<(), Error> {
        serde_json::to_writer(&mut self.out, s).map_err(|e| Error(e.to_string()))
    }

    fn number<N: Serialize>(&mut self, n: N) -> Result<(), Error> {
        serde_json::to_writer(&mut self.out, &n).map_err(|e| Error(e.to_string()))
    }

    fn object(&mut self, len: Option<usize>) -> Object<'_> {
        Object {
            start: self.out.len(),
            entries: Vec::with_capacity(len.unwrap_or(0)),
            key: None,
            encoder: self,
        }
    }

    fn array(&mut self) -> Array<'_> {
        self.out.push(b'[');
        Array {
            first: true,
            encoder: self,
        }
    }

    /// `{"<variant>": ` of an externally tagged variant with content.
    fn variant_open(&mut self, variant: &'static str) -> Result<(), Error> {
        self.out.push(b'{');
        self.string(variant)?;
        self.out.push(b':');
        Ok(())
    }
}

/// An object being written: its values, one after another from `start`,
/// until its end puts them in key order with their keys.
pub(crate) struct Object<'a> {
    encoder: &'a mut Encoder,
    start: usize,
    /// Each entry's key and where its value's text ends.
    entries: Vec<(Cow<'static, str>, usize)>,
    /// The key of a map entry whose value is next.
    key: Option<Cow<'static, str>>,
}

impl Object<'_> {
    fn entry<T: Serialize + ?Sized>(
        &mut self,
        key: Cow<'static, str>,
        value: &T,
    ) -> Result<(), Error> {
        self.encoder.path.push(Segment::Key(key));
        let written = self.encoder.value(value);
        let Some(Segment::Key(key)) = self.encoder.path.pop() else {
            return Err(Error("the path lost its key".into()));
        };
        written?;
        self.entries.push((key, self.encoder.out.len()));
        Ok(())
    }

    /// Writes the entries in key order, the last of equal keys kept (as a
    /// map would).
    fn finish(self) -> Result<(), Error> {
        let Object {
            encoder,
            start,
            entries,
            ..
        } = self;
        let mut spans = Vec::with_capacity(entries.len());
        let mut from = 0;
        for (key, end) in entries {
            spans.push((key, from, end - start));
            from = end - start;
        }
        // Stable: of equal keys, the last written is last.
        spans.sort_by(|a, b| a.0.cmp(&b.0));
        let mut scratch = std::mem::take(&mut encoder.scratch);
        scratch.clear();
        scratch.extend_from_slice(&encoder.out[start..]);
        encoder.out.truncate(start);
        encoder.out.push(b'{');
        let mut first = true;
        for (i, (key, from, to)) in spans.iter().enumerate() {
            if spans.get(i + 1).is_some_and(|next| next.0 == *key) {
                continue;
            }
            if !first {
                encoder.out.push(b',');
            }
            first = false;
            encoder.string(key)?;
            encoder.out.push(b':');
            encoder.out.extend_from_slice(&scratch[*from..*to]);
        }
        encoder.out.push(b'}');
        encoder.scratch = scratch;
        Ok(())
    }
}

/// An array being written.
pub(crate) struct Array<'a> {
    encoder: &'a mut Encoder,
    first: bool,
}

impl Array<'_> {
    fn element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        if !self.first {
            self.encoder.out.push(b',');
        }
        self.first = false;
        self.encoder.path.push(Segment::Index);
        let written = self.encoder.value(value);
        self.encoder.path.pop();
        written
    }

    fn finish(self) {
        self.encoder.out.push(b']');
    }
}

/// The private name under which `serde_json` passes a raw value through a
/// serializer.
const RAW_VALUE: &str = "$serde_json::private::RawValue";

impl<'a> ser::Serializer for &'a mut Encoder {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = Array<'a>;
    type SerializeTuple = Array<'a>;
    type SerializeTupleStruct = Array<'a>;
    type SerializeTupleVariant = Array<'a>;
    type SerializeMap = Object<'a>;
    type SerializeStruct = Object<'a>;
    type SerializeStructVariant = Object<'a>;

    fn serialize_bool(self, v: bool) -> Result<(), Error> {
        self.out
            .extend_from_slice(if v { b"true" } else { b"false" });
        Ok(())
    }
    fn serialize_i8(self, v: i8) -> Result<(), Error> {
        self.number(v)
    }
    fn serialize_i16(self, v: i16) -> Result<(), Error> {
        self.number(v)
    }
    fn serialize_i32(self, v: i32) -> Result<(), Error> {
        self.number(v)
    }
    fn serialize_i64(self, v: i64) -> Result<(), Error> {
        self.number(v)
    }
    fn serialize_i128(self, v: i128) -> Result<(), Error> {
        // A `Value` number holds 64 bits at most.
        match (u64::try_from(v), i64::try_from(v)) {
            (Ok(v), _) => self.number(v),
            (_, Ok(v)) => self.number(v),
            _ => Err(Error("number out of range".into())),
        }
    }
    fn serialize_u8(self, v: u8) -> Result<(), Error> {
        self.number(v)
    }
    fn serialize_u16(self, v: u16) -> Result<(), Error> {
        self.number(v)
    }
    fn serialize_u32(self, v: u32) -> Result<(), Error> {
        self.number(v)
    }
    fn serialize_u64(self, v: u64) -> Result<(), Error> {
        self.number(v)
    }
    fn serialize_u128(self, v: u128) -> Result<(), Error> {
        let v = u64::try_from(v).map_err(|_| Error("number out of range".into()))?;
        self.number(v)
    }
    fn serialize_f32(self, v: f32) -> Result<(), Error> {
        // A `Value` keeps an `f32` as the `f64` it converts to.
        self.number(f64::from(v))
    }
    fn serialize_f64(self, v: f64) -> Result<(), Error> {
        self.number(v)
    }
    fn serialize_char(self, v: char) -> Result<(), Error> {
        self.string(v.encode_utf8(&mut [0; 4]))
    }
    fn serialize_str(self, v: &str) -> Result<(), Error> {
        self.string(v)
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<(), Error> {
        let mut array = self.array();
        for b in v {
            array.element(b)?;
        }
        array.finish();
        Ok(())
    }
    fn serialize_none(self) -> Result<(), Error> {
        self.serialize_unit()
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), Error> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), Error> {
        self.out.extend_from_slice(b"null");
        Ok(())
    }
    fn serialize_unit_struct(self, _name: &'static str) -> Result<(), Error> {
        self.serialize_unit()
    }
    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
    ) -> Result<(), Error> {
        self.string(variant)
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        self.variant_open(variant)?;
        // The content's path goes through the variant's name, as a map
        // key's would.
        self.path.push(Segment::Key(Cow::Borrowed(variant)));
        let written = self.value(value);
        self.path.pop();
        written?;
        self.out.push(b'}');
        Ok(())
    }
    fn serialize_seq(self, _len: Option<usize>) -> Result<Array<'a>, Error> {
        Ok(self.array())
    }
    fn serialize_tuple(self, _len: usize) -> Result<Array<'a>, Error> {
        Ok(self.array())
    }
    fn serialize_tuple_struct(self, _name: &'static str, _len: usize) -> Result<Array<'a>, Error> {
        Ok(self.array())
    }
    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Array<'a>, Error> {
        self.variant_open(variant)?;
        // Its contents' path goes through the variant's name (popped at
        // its end).
        self.path.push(Segment::Key(Cow::Borrowed(variant)));
        Ok(self.array())
    }
    fn serialize_map(self, len: Option<usize>) -> Result<Object<'a>, Error> {
        Ok(self.object(len))
    }
    fn serialize_struct(self, name: &'static str, len: usize) -> Result<Object<'a>, Error> {
        if name == RAW_VALUE {
            return Err(Error("a raw JSON value cannot be kept in a trace".into()));
        }
        Ok(self.object(Some(len)))
    }
    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Object<'a>, Error> {
        self.variant_open(variant)?;
        // As for a tuple variant.
        self.path.push(Segment::Key(Cow::Borrowed(variant)));
        Ok(self.object(Some(len)))
    }
}

impl ser::SerializeSeq for Array<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.element(value)
    }
    fn end(self) -> Result<(), Error> {
        self.finish();
        Ok(())
    }
}

impl ser::SerializeTuple for Array<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.element(value)
    }
    fn end(self) -> Result<(), Error> {
        self.finish();
        Ok(())
    }
}

impl ser::SerializeTupleStruct for Array<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.element(value)
    }
    fn end(self) -> Result<(), Error> {
        self.finish();
        Ok(())
    }
}

impl ser::SerializeTupleVariant for Array<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.element(value)
    }
    fn end(self) -> Result<(), Error> {
        self.encoder.path.pop();
        self.encoder.out.extend_from_slice(b"]}");
        Ok(())
    }
}

impl ser::SerializeMap for Object<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), Error> {
        self.key = Some(Cow::Owned(key.serialize(KeySerializer)?));
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        let key = self
            .key
            .take()
            .ok_or_else(|| Error("a map value without its key".into()))?;
        self.entry(key, value)
    }
    fn end(self) -> Result<(), Error> {
        self.finish()
    }
}

impl ser::SerializeStruct for Object<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        self.entry(Cow::Borrowed(key), value)
    }
    fn end(self) -> Result<(), Error> {
        self.finish()
    }
}

impl ser::SerializeStructVariant for Object<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        self.entry(Cow::Borrowed(key), value)
    }
    fn end(self) -> Result<(), Error> {
        self.finish_variant()
    }
}

impl Object<'_> {
    fn finish_variant(self) -> Result<(), Error> {
        // The object itself, then the brace of the variant around it.
        let Object {
            encoder,
            start,
            entries,
            key,
        } = self;
        let inner = Object {
            encoder: &mut *encoder,
            start,
            entries,
            key,
        };
        inner.finish()?;
        encoder.path.pop();
        encoder.out.push(b'}');
        Ok(())
    }
}

/// A map key as a `Value`'s map takes it: a string, or a number, a bool or
/// a unit variant written as one.
struct KeySerializer;

impl ser::Serializer for KeySerializer {
    type Ok = String;
    type Error = Error;
    type SerializeSeq = Impossible<String, Error>;
    type SerializeTuple = Impossible<String, Error>;
    type SerializeTupleStruct = Impossible<String, Error>;
    type SerializeTupleVariant = Impossible<String, Error>;
    type SerializeMap = Impossible<String, Error>;
    type SerializeStruct = Impossible<String, Error>;
    type SerializeStructVariant = Impossible<String, Error>;

    fn serialize_bool(self, v: bool) -> Result<String, Error> {
        Ok(v.to_string())
    }
    fn serialize_i8(self, v: i8) -> Result<String, Error> {
        Ok(v.to_string())
    }
    fn serialize_i16(self, v: i16) -> Result<String, Error> {
        Ok(v.to_string())
    }
    fn serialize_i32(self, v: i32) -> Result<String, Error> {
        Ok(v.to_string())
    }
    fn serialize_i64(self, v: i64) -> Result<String, Error> {
        Ok(v.to_string())
    }
    fn serialize_i128(self, v: i128) -> Result<String, Error> {
        Ok(v.to_string())
    }
    fn serialize_u8(self, v: u8) -> Result<String, Error> {
        Ok(v.to_string())
    }
    fn serialize_u16(self, v: u16) -> Result<String, Error> {
        Ok(v.to_string())
    }
    fn serialize_u32(self, v: u32) -> Result<String, Error> {
        Ok(v.to_string())
    }
    fn serialize_u64(self, v: u64) -> Result<String, Error> {
        Ok(v.to_string())
    }
    fn serialize_u128(self, v: u128) -> Result<String, Error> {
        Ok(v.to_string())
    }
    fn serialize_f32(self, v: f32) -> Result<String, Error> {
        if v.is_finite() {
            serde_json::to_string(&v).map_err(|e| Error(e.to_string()))
        } else {
            Err(Error("a map key that is not a finite number".into()))
        }
    }
    fn serialize_f64(self, v: f64) -> Result<String, Error> {
        if v.is_finite() {
            serde_json::to_string(&v).map_err(|e| Error(e.to_string()))
        } else {
            Err(Error("a map key that is not a finite number".into()))
        }
    }
    fn serialize_char(self, v: char) -> Result<String, Error> {
        Ok(v.to_string())
    }
    fn serialize_str(self, v: &str) -> Result<String, Error> {
        Ok(v.to_owned())
    }
    fn serialize_bytes(self, _v: &[u8]) -> Result<String, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_none(self) -> Result<String, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, _value: &T) -> Result<String, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_unit(self) -> Result<String, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_unit_struct(self, _name: &'static str) -> Result<String, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
    ) -> Result<String, Error> {
        Ok(variant.to_owned())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<String, Error> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
        _value: &T,
    ) -> Result<String, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_seq(self, _len: Option<usize>) -> Result<Self::SerializeSeq, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_tuple(self, _len: usize) -> Result<Self::SerializeTuple, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_tuple_struct(
        self,
        _name: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeTupleStruct, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeTupleVariant, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_map(self, _len: Option<usize>) -> Result<Self::SerializeMap, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_struct(
        self,
        _name: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeStruct, Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeStructVariant, Error> {
        Err(key_must_be_a_string())
    }
}

fn key_must_be_a_string() -> Error {
    Error("key must be a string".into())
}
