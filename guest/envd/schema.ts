// Message tables for envd's two Connect services, transcribed from E2B's spec/envd/*.proto
// (field numbers checked against the descriptors embedded in the e2b SDK).
import { Registry } from "./proto.ts";

export const schema = new Registry()
  // ---- process ----
  .enum("process.Signal", { SIGNAL_UNSPECIFIED: 0, SIGNAL_SIGTERM: 15, SIGNAL_SIGKILL: 9 })
  .message("process.PTY", "size=1:process.PTY.Size")
  .message("process.PTY.Size", "cols=1:uint32, rows=2:uint32")
  .message("process.ProcessConfig", "cmd=1:string, args=2:string[], envs=3:map, cwd=4:string?")
  .message("process.ListRequest", "")
  .message("process.ProcessInfo", "config=1:process.ProcessConfig, pid=2:uint32, tag=3:string?")
  .message("process.ListResponse", "processes=1:process.ProcessInfo[]")
  .message("process.StartRequest", "process=1:process.ProcessConfig, pty=2:process.PTY?, tag=3:string?, stdin=4:bool?")
  .message("process.UpdateRequest", "process=1:process.ProcessSelector, pty=2:process.PTY?")
  .message("process.UpdateResponse", "")
  .message(
    "process.ProcessEvent",
    "start=1:process.ProcessEvent.StartEvent@event, data=2:process.ProcessEvent.DataEvent@event," +
      "end=3:process.ProcessEvent.EndEvent@event, keepalive=4:process.ProcessEvent.KeepAlive@event",
  )
  .message("process.ProcessEvent.StartEvent", "pid=1:uint32")
  .message("process.ProcessEvent.DataEvent", "stdout=1:bytes@output, stderr=2:bytes@output, pty=3:bytes@output")
  .message("process.ProcessEvent.EndEvent", "exit_code=1:sint32, exited=2:bool, status=3:string, error=4:string?")
  .message("process.ProcessEvent.KeepAlive", "")
  .message("process.StartResponse", "event=1:process.ProcessEvent")
  .message("process.ConnectResponse", "event=1:process.ProcessEvent")
  .message("process.SendInputRequest", "process=1:process.ProcessSelector, input=2:process.ProcessInput")
  .message("process.SendInputResponse", "")
  .message("process.ProcessInput", "stdin=1:bytes@input, pty=2:bytes@input")
  .message(
    "process.StreamInputRequest",
    "start=1:process.StreamInputRequest.StartEvent@event, data=2:process.StreamInputRequest.DataEvent@event," +
      "keepalive=3:process.StreamInputRequest.KeepAlive@event",
  )
  .message("process.StreamInputRequest.StartEvent", "process=1:process.ProcessSelector")
  .message("process.StreamInputRequest.DataEvent", "input=2:process.ProcessInput")
  .message("process.StreamInputRequest.KeepAlive", "")
  .message("process.StreamInputResponse", "")
  .message("process.SendSignalRequest", "process=1:process.ProcessSelector, signal=2:process.Signal")
  .message("process.SendSignalResponse", "")
  .message("process.CloseStdinRequest", "process=1:process.ProcessSelector")
  .message("process.CloseStdinResponse", "")
  .message("process.ConnectRequest", "process=1:process.ProcessSelector")
  .message("process.ProcessSelector", "pid=1:uint32@selector, tag=2:string@selector")
  // ---- filesystem ----
  .enum("filesystem.FileType", { FILE_TYPE_UNSPECIFIED: 0, FILE_TYPE_FILE: 1, FILE_TYPE_DIRECTORY: 2, FILE_TYPE_SYMLINK: 3 })
  .enum("filesystem.EventType", {
    EVENT_TYPE_UNSPECIFIED: 0,
    EVENT_TYPE_CREATE: 1,
    EVENT_TYPE_WRITE: 2,
    EVENT_TYPE_REMOVE: 3,
    EVENT_TYPE_RENAME: 4,
    EVENT_TYPE_CHMOD: 5,
  })
  .message("filesystem.MoveRequest", "source=1:string, destination=2:string")
  .message("filesystem.MoveResponse", "entry=1:filesystem.EntryInfo")
  .message("filesystem.MakeDirRequest", "path=1:string")
  .message("filesystem.MakeDirResponse", "entry=1:filesystem.EntryInfo")
  .message("filesystem.RemoveRequest", "path=1:string")
  .message("filesystem.RemoveResponse", "")
  .message("filesystem.StatRequest", "path=1:string")
  .message("filesystem.StatResponse", "entry=1:filesystem.EntryInfo")
  .message(
    "filesystem.EntryInfo",
    "name=1:string, type=2:filesystem.FileType, path=3:string, size=4:int64, mode=5:uint32, permissions=6:string," +
      "owner=7:string, group=8:string, modified_time=9:google.protobuf.Timestamp, symlink_target=10:string?, metadata=11:map",
  )
  .message("filesystem.ListDirRequest", "path=1:string, depth=2:uint32")
  .message("filesystem.ListDirResponse", "entries=1:filesystem.EntryInfo[]")
  .message("filesystem.WatchDirRequest", "path=1:string, recursive=2:bool, include_entry=3:bool, allow_network_mounts=4:bool")
  .message("filesystem.FilesystemEvent", "name=1:string, type=2:filesystem.EventType, entry=3:filesystem.EntryInfo?")
  .message(
    "filesystem.WatchDirResponse",
    "start=1:filesystem.WatchDirResponse.StartEvent@event, filesystem=2:filesystem.FilesystemEvent@event," +
      "keepalive=3:filesystem.WatchDirResponse.KeepAlive@event",
  )
  .message("filesystem.WatchDirResponse.StartEvent", "")
  .message("filesystem.WatchDirResponse.KeepAlive", "")
  .message("filesystem.CreateWatcherRequest", "path=1:string, recursive=2:bool, include_entry=3:bool, allow_network_mounts=4:bool")
  .message("filesystem.CreateWatcherResponse", "watcher_id=1:string")
  .message("filesystem.GetWatcherEventsRequest", "watcher_id=1:string")
  .message("filesystem.GetWatcherEventsResponse", "events=1:filesystem.FilesystemEvent[]")
  .message("filesystem.RemoveWatcherRequest", "watcher_id=1:string")
  .message("filesystem.RemoveWatcherResponse", "");

export const FileType = { UNSPECIFIED: 0, FILE: 1, DIRECTORY: 2, SYMLINK: 3 } as const;
export const EventType = { CREATE: 1, WRITE: 2, REMOVE: 3, RENAME: 4, CHMOD: 5 } as const;
