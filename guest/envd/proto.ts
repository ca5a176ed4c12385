// Table-driven protobuf: one schema drives both the binary wire format and the proto3 JSON mapping.
//
// Schema DSL, one string per message: "name=no:type, ..." where type is a scalar, an enum or a
// message name, suffixed with "[]" (repeated), "?" (proto3 optional) or "@group" (oneof member);
// "map" is map<string,string>. Decoded values: strings, booleans, numbers (64-bit ints too),
// Uint8Array for bytes, enum numbers, plain objects for messages. Absent fields stay undefined so
// handlers can see presence.

export class ProtoError extends Error {}

const SCALARS = new Set(["string", "bytes", "bool", "uint32", "int32", "sint32", "uint64", "int64", "sint64"]);
const TIMESTAMP = "google.protobuf.Timestamp";

export interface Field {
  name: string; // proto (snake_case) name
  json: string; // lowerCamelCase JSON name, also the key used in decoded objects
  no: number;
  type: string;
  repeated: boolean;
  map: boolean;
  optional: boolean;
  oneof?: string;
}

interface Msg {
  name: string;
  fields: Field[];
  byNo: Map<number, Field>;
  byKey: Map<string, Field>; // JSON and proto names both accepted on input
}

interface Enum {
  byName: Map<string, number>;
  byNo: Map<number, string>;
}

const camel = (s: string) => s.replace(/_([a-z0-9])/g, (_, c: string) => c.toUpperCase());

export class Registry {
  private msgs = new Map<string, Msg>();
  private enums = new Map<string, Enum>();

  constructor() {
    this.message(TIMESTAMP, "seconds=1:int64, nanos=2:int32");
  }

  enum(name: string, values: Record<string, number>): this {
    const e: Enum = { byName: new Map(), byNo: new Map() };
    for (const [k, v] of Object.entries(values)) {
      e.byName.set(k, v);
      e.byNo.set(v, k);
    }
    this.enums.set(name, e);
    return this;
  }

  message(name: string, spec: string): this {
    const fields: Field[] = [];
    for (const part of spec.split(",").map((s) => s.trim()).filter(Boolean)) {
      const m = /^(\w+)=(\d+):([\w.]+)(\[\]|\?)?(?:@(\w+))?$/.exec(part);
      if (!m) throw new Error(`bad field spec ${name}: ${part}`);
      const [, fname, no, type, mod, oneof] = m as unknown as [string, string, string, string, string?, string?];
      fields.push({
        name: fname,
        json: camel(fname),
        no: Number(no),
        type,
        repeated: mod === "[]",
        map: type === "map",
        optional: mod === "?",
        oneof,
      });
    }
    fields.sort((a, b) => a.no - b.no);
    const msg: Msg = { name, fields, byNo: new Map(), byKey: new Map() };
    for (const f of fields) {
      msg.byNo.set(f.no, f);
      msg.byKey.set(f.json, f);
      msg.byKey.set(f.name, f);
    }
    this.msgs.set(name, msg);
    return this;
  }

  has(name: string): boolean {
    return this.msgs.has(name);
  }

  private msg(name: string): Msg {
    const m = this.msgs.get(name);
    if (!m) throw new Error(`unknown message ${name}`);
    return m;
  }

  // ---- binary ----

  encode(name: string, value: Record<string, unknown>): Uint8Array {
    const w = new Writer();
    this.encodeInto(w, this.msg(name), value ?? {});
    return w.finish();
  }

  private encodeInto(w: Writer, msg: Msg, obj: Record<string, unknown>) {
    for (const f of msg.fields) {
      const v = obj[f.json];
      if (v === undefined || v === null) continue;
      if (f.map) {
        for (const [k, val] of Object.entries(v as Record<string, string>)) {
          const sub = new Writer();
          sub.tag(1, 2).string(k);
          sub.tag(2, 2).string(String(val));
          w.tag(f.no, 2).bytes(sub.finish());
        }
      } else if (f.repeated) {
        for (const item of v as unknown[]) this.encodeValue(w, f, item);
      } else {
        if (!f.optional && !f.oneof && isDefault(f.type, v)) continue;
        this.encodeValue(w, f, v);
      }
    }
  }

  private encodeValue(w: Writer, f: Field, v: unknown) {
    switch (f.type) {
      case "string": return void w.tag(f.no, 2).string(String(v));
      case "bytes": return void w.tag(f.no, 2).bytes(v as Uint8Array);
      case "bool": return void w.tag(f.no, 0).varint(v ? 1 : 0);
      case "uint32": case "uint64": case "int32": case "int64":
        return void w.tag(f.no, 0).varint(Number(v));
      case "sint32": case "sint64": {
        const n = Number(v);
        return void w.tag(f.no, 0).varint(n >= 0 ? n * 2 : -n * 2 - 1);
      }
    }
    if (this.enums.has(f.type)) return void w.tag(f.no, 0).varint(Number(v));
    const sub = new Writer();
    this.encodeInto(sub, this.msg(f.type), v as Record<string, unknown>);
    w.tag(f.no, 2).bytes(sub.finish());
  }

  decode(name: string, buf: Uint8Array): Record<string, unknown> {
    return this.decodeFrom(new Reader(buf), this.msg(name), buf.length);
  }

  private decodeFrom(r: Reader, msg: Msg, end: number): Record<string, unknown> {
    const out: Record<string, unknown> = {};
    while (r.pos < end) {
      const tag = r.uint32();
      const no = tag >>> 3;
      const wt = tag & 7;
      if (no === 0) throw new ProtoError("invalid field number 0");
      const f = msg.byNo.get(no);
      if (!f) {
        r.skip(wt);
        continue;
      }
      if (f.map) {
        expectWire(f, wt, 2);
        const len = r.uint32();
        const stop = r.pos + len;
        r.check(stop);
        let k = "";
        let val = "";
        while (r.pos < stop) {
          const t = r.uint32();
          if (t === 0x0a) k = r.string();
          else if (t === 0x12) val = r.string();
          else r.skip(t & 7);
        }
        ((out[f.json] ??= {}) as Record<string, string>)[k] = val;
        continue;
      }
      if (f.repeated && wt === 2 && isPackable(this, f.type)) {
        const len = r.uint32();
        const stop = r.pos + len;
        r.check(stop);
        const arr = (out[f.json] ??= []) as unknown[];
        while (r.pos < stop) arr.push(this.decodeScalar(r, f));
        continue;
      }
      const v = this.decodeValue(r, f, wt);
      if (f.repeated) ((out[f.json] ??= []) as unknown[]).push(v);
      else {
        if (f.oneof) for (const o of msg.fields) if (o.oneof === f.oneof) delete out[o.json];
        out[f.json] = v;
      }
    }
    if (r.pos !== end) throw new ProtoError("truncated message");
    return out;
  }

  private decodeValue(r: Reader, f: Field, wt: number): unknown {
    if (f.type === "string") return expectWire(f, wt, 2), r.string();
    if (f.type === "bytes") return expectWire(f, wt, 2), r.bytes().slice();
    if (SCALARS.has(f.type) || this.enums.has(f.type)) return expectWire(f, wt, 0), this.decodeScalar(r, f);
    expectWire(f, wt, 2);
    const len = r.uint32();
    const stop = r.pos + len;
    r.check(stop);
    return this.decodeFrom(r, this.msg(f.type), stop);
  }

  private decodeScalar(r: Reader, f: Field): number | boolean {
    const [lo, hi] = r.varint64();
    switch (f.type) {
      case "bool": return lo !== 0 || hi !== 0;
      case "int32": return lo | 0;
      case "sint32": return (lo >>> 1) ^ -(lo & 1);
      case "uint64": return hi * 2 ** 32 + lo;
      case "int64": return hi & 0x80000000 ? -((~hi >>> 0) * 2 ** 32 + (~lo >>> 0) + 1) : hi * 2 ** 32 + lo;
      case "sint64": {
        const u = BigInt(hi) * 2n ** 32n + BigInt(lo);
        return Number((u >> 1n) ^ -(u & 1n));
      }
      default: return lo; // uint32, enums
    }
  }

  // ---- proto3 JSON ----

  toJson(name: string, value: Record<string, unknown>): Record<string, unknown> {
    return this.msgToJson(this.msg(name), value ?? {}) as Record<string, unknown>;
  }

  private msgToJson(msg: Msg, obj: Record<string, unknown>): unknown {
    if (msg.name === TIMESTAMP) return timestampToJson(obj);
    const out: Record<string, unknown> = {};
    for (const f of msg.fields) {
      const v = obj[f.json];
      if (v === undefined || v === null) continue;
      if (f.map) {
        const m = v as Record<string, string>;
        if (Object.keys(m).length) out[f.json] = { ...m };
      } else if (f.repeated) {
        const arr = v as unknown[];
        if (arr.length) out[f.json] = arr.map((x) => this.valueToJson(f, x));
      } else if (f.optional || f.oneof || !isDefault(f.type, v)) {
        out[f.json] = this.valueToJson(f, v);
      }
    }
    return out;
  }

  private valueToJson(f: Field, v: unknown): unknown {
    switch (f.type) {
      case "bytes": return Buffer.from(v as Uint8Array).toString("base64");
      case "int64": case "uint64": case "sint64": return String(v);
      case "string": case "bool": case "int32": case "uint32": case "sint32": return v;
    }
    const e = this.enums.get(f.type);
    if (e) return e.byNo.get(Number(v)) ?? Number(v);
    return this.msgToJson(this.msg(f.type), v as Record<string, unknown>);
  }

  fromJson(name: string, json: unknown): Record<string, unknown> {
    return this.msgFromJson(this.msg(name), json, name);
  }

  private msgFromJson(msg: Msg, json: unknown, at: string): Record<string, unknown> {
    if (typeof json !== "object" || json === null || Array.isArray(json)) throw new ProtoError(`${at}: expected object`);
    const out: Record<string, unknown> = {};
    const seenOneof = new Map<string, string>();
    for (const [k, v] of Object.entries(json)) {
      const f = msg.byKey.get(k);
      if (!f || v === null) continue; // unknown fields are discarded, null means unset
      const path = `${at}.${f.json}`;
      if (f.oneof) {
        const prev = seenOneof.get(f.oneof);
        if (prev) throw new ProtoError(`${path}: oneof ${f.oneof} already set by ${prev}`);
        seenOneof.set(f.oneof, f.json);
      }
      if (f.map) {
        if (typeof v !== "object" || Array.isArray(v)) throw new ProtoError(`${path}: expected object`);
        const m: Record<string, string> = {};
        for (const [mk, mv] of Object.entries(v as object)) {
          if (typeof mv !== "string") throw new ProtoError(`${path}.${mk}: expected string`);
          m[mk] = mv;
        }
        out[f.json] = m;
      } else if (f.repeated) {
        if (!Array.isArray(v)) throw new ProtoError(`${path}: expected array`);
        out[f.json] = v.map((x, i) => this.valueFromJson(f, x, `${path}[${i}]`));
      } else {
        const val = this.valueFromJson(f, v, path);
        if (val !== undefined) out[f.json] = val;
      }
    }
    return out;
  }

  private valueFromJson(f: Field, v: unknown, path: string): unknown {
    switch (f.type) {
      case "string":
        if (typeof v !== "string") throw new ProtoError(`${path}: expected string`);
        return v;
      case "bool":
        if (typeof v !== "boolean") throw new ProtoError(`${path}: expected boolean`);
        return v;
      case "bytes":
        if (typeof v !== "string" || !/^[A-Za-z0-9+/_-]*={0,2}$/.test(v)) throw new ProtoError(`${path}: expected base64 string`);
        return new Uint8Array(Buffer.from(v.replace(/-/g, "+").replace(/_/g, "/"), "base64"));
      case "int32": case "uint32": case "sint32": case "int64": case "uint64": case "sint64":
        return intFromJson(f.type, v, path);
    }
    const e = this.enums.get(f.type);
    if (e) {
      if (typeof v === "number" && Number.isInteger(v)) return v;
      if (typeof v === "string") return e.byName.get(v); // unknown names are discarded like unknown fields
      throw new ProtoError(`${path}: expected enum name or number`);
    }
    const m = this.msg(f.type);
    if (m.name === TIMESTAMP) return timestampFromJson(v, path);
    return this.msgFromJson(m, v, path);
  }
}

function isDefault(type: string, v: unknown): boolean {
  if (type === "string") return v === "";
  if (type === "bytes") return (v as Uint8Array).length === 0;
  if (type === "bool") return v === false;
  if (SCALARS.has(type)) return Number(v) === 0;
  if (typeof v === "number") return v === 0; // enums
  return false; // a set message field is always emitted
}

function isPackable(reg: Registry, type: string): boolean {
  return type !== "string" && type !== "bytes" && (SCALARS.has(type) || !reg.has(type));
}

function expectWire(f: Field, got: number, want: number) {
  if (got !== want) throw new ProtoError(`field ${f.name}: wire type ${got}, expected ${want}`);
}

const INT_LIMITS: Record<string, [number, number]> = {
  int32: [-(2 ** 31), 2 ** 31 - 1],
  sint32: [-(2 ** 31), 2 ** 31 - 1],
  uint32: [0, 2 ** 32 - 1],
  int64: [-(2 ** 63), 2 ** 63],
  sint64: [-(2 ** 63), 2 ** 63],
  uint64: [0, 2 ** 64],
};

function intFromJson(type: string, v: unknown, path: string): number {
  const n = typeof v === "string" && /^-?\d+(\.0+)?$|^-?\d+(\.\d+)?e\+?\d+$/i.test(v.trim()) ? Number(v) : v;
  if (typeof n !== "number" || !Number.isInteger(n)) throw new ProtoError(`${path}: expected integer`);
  const [lo, hi] = INT_LIMITS[type]!;
  if (n < lo || n > hi) throw new ProtoError(`${path}: ${type} out of range`);
  return n;
}

function timestampToJson(ts: Record<string, unknown>): string {
  const secs = Number(ts.seconds ?? 0);
  const nanos = Number(ts.nanos ?? 0);
  const iso = new Date(secs * 1000).toISOString().replace(/\.\d{3}Z$/, "");
  if (!nanos) return `${iso}Z`;
  let frac = String(nanos).padStart(9, "0");
  frac = frac.endsWith("000000") ? frac.slice(0, 3) : frac.endsWith("000") ? frac.slice(0, 6) : frac;
  return `${iso}.${frac}Z`;
}

function timestampFromJson(v: unknown, path: string): Record<string, number> {
  const m = typeof v === "string" && /^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)$/.exec(v);
  if (!m) throw new ProtoError(`${path}: expected RFC 3339 timestamp`);
  const ms = Date.parse(`${m[1]}${m[3]}`);
  if (Number.isNaN(ms)) throw new ProtoError(`${path}: invalid timestamp`);
  return { seconds: Math.floor(ms / 1000), nanos: Number((m[2] ?? "").padEnd(9, "0")) };
}

class Writer {
  private buf = new Uint8Array(64);
  private len = 0;

  private ensure(n: number) {
    if (this.len + n <= this.buf.length) return;
    const next = new Uint8Array(Math.max(this.buf.length * 2, this.len + n));
    next.set(this.buf.subarray(0, this.len));
    this.buf = next;
  }

  varint(n: number): this {
    this.ensure(10);
    if (n < 0) {
      // Negative int32/int64 travel as 10-byte two's complement.
      let b = BigInt.asUintN(64, BigInt(Math.trunc(n)));
      while (b > 0x7fn) {
        this.buf[this.len++] = Number(b & 0x7fn) | 0x80;
        b >>= 7n;
      }
      this.buf[this.len++] = Number(b);
      return this;
    }
    while (n > 0x7f) {
      this.buf[this.len++] = (n % 128) | 0x80;
      n = Math.floor(n / 128);
    }
    this.buf[this.len++] = n;
    return this;
  }

  tag(no: number, wt: number): this {
    return this.varint(no * 8 + wt);
  }

  bytes(b: Uint8Array): this {
    this.varint(b.length);
    this.ensure(b.length);
    this.buf.set(b, this.len);
    this.len += b.length;
    return this;
  }

  string(s: string): this {
    return this.bytes(new TextEncoder().encode(s));
  }

  finish(): Uint8Array {
    return this.buf.slice(0, this.len);
  }
}

const utf8 = new TextDecoder("utf-8", { fatal: true });

class Reader {
  pos = 0;
  constructor(private buf: Uint8Array) {}

  check(end: number) {
    if (end > this.buf.length) throw new ProtoError("truncated message");
  }

  varint64(): [number, number] {
    let lo = 0;
    let hi = 0;
    for (let i = 0; i < 10; i++) {
      if (this.pos >= this.buf.length) throw new ProtoError("truncated varint");
      const b = this.buf[this.pos++]!;
      if (i < 4) lo |= (b & 0x7f) << (i * 7);
      else if (i === 4) {
        lo |= (b & 0x0f) << 28;
        hi |= (b & 0x7f) >> 4;
      } else hi |= (b & 0x7f) << (i * 7 - 32);
      if (!(b & 0x80)) return [lo >>> 0, hi >>> 0];
    }
    throw new ProtoError("varint too long");
  }

  uint32(): number {
    return this.varint64()[0];
  }

  bytes(): Uint8Array {
    const len = this.uint32();
    const end = this.pos + len;
    this.check(end);
    const out = this.buf.subarray(this.pos, end);
    this.pos = end;
    return out;
  }

  string(): string {
    try {
      return utf8.decode(this.bytes());
    } catch (e) {
      if (e instanceof ProtoError) throw e;
      throw new ProtoError("invalid UTF-8 in string field");
    }
  }

  skip(wt: number) {
    if (wt === 0) this.varint64();
    else if (wt === 1) this.pos += 8;
    else if (wt === 2) this.bytes();
    else if (wt === 5) this.pos += 4;
    else throw new ProtoError(`unsupported wire type ${wt}`);
    this.check(this.pos);
  }
}
